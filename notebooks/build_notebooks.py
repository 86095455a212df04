"""Write the inspection notebooks from this file, outputs cleared: ``python notebooks/build_notebooks.py``.

Notebooks are JSON that diffs badly; the cells live here as plain Python strings so that a change is
reviewed as code. ``tests/notebooks`` executes the written notebooks top to bottom and checks that
this file and the ``.ipynb`` files agree (rerun this script after editing a cell).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

# Both notebooks start here: find the repository (recipes use paths relative to it), read settings.
SETUP = '''\
import os
from pathlib import Path

from IPython.display import Image, display

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").exists() and (p / "hsstore").is_dir())
os.chdir(ROOT)  # recipes and lineage paths are relative to the repository root
WORK_DIR = Path(os.environ.get("WORK_DIR", "runs/notebooks"))    # where stores and sweeps are created
PLOTS_DIR = Path(os.environ.get("PLOTS_DIR", WORK_DIR / "plots"))  # where the PNGs go
PLOTS_DIR.mkdir(parents=True, exist_ok=True)
print("repository:", ROOT, "| work dir:", WORK_DIR, "| plots:", PLOTS_DIR)'''

# Create a small store from the reference target unless STORE names one (shared by both notebooks).
MAKE_STORE = '''\
import hsstore

STORE = os.environ.get("STORE")
if STORE is None:
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    STORE = str(WORK_DIR / "reference-store-bf16")
    recipe = build_recipe(ExtractRecipe, {
        "target": "examples/reference-target",              # the in-repo reference target (Qwen3, 8 layers)
        "data": ["examples/data/draft_train_slice.jsonl"],  # the in-repo slice of the training data
        "store": STORE,
        "limit": 24,                                         # a small slice: seconds on a CPU
        "executor": "local",                                 # in process; "ray" for actors
        "model": {"dtype": "float32", "device": "cpu"},
        "batching": {"max_length": 384, "too_long": "truncate", "token_budget": 4096},
    })
    print(run_extraction(recipe).format())                   # a rerun resumes: nothing is extracted twice
store = hsstore.open_store(STORE)
store'''

INSPECT_CELLS = [
    new_markdown_cell(
        "# Inspecting a store\n\n"
        "What a hidden-state store holds and how its features look: the summary `hsstore inspect` prints, "
        "the per-sample and per-token tables behind it, per-layer norm and outlier statistics, and the "
        "error an fp8 codec costs against bf16. Set `STORE` to inspect your own store; without it the "
        "notebook extracts a small one from the in-repo reference target (under a minute on a CPU). "
        "`WORK_DIR` and `PLOTS_DIR` say where stores and PNGs go."
    ),
    new_code_cell(SETUP),
    new_code_cell(MAKE_STORE),
    new_markdown_cell(
        "## The summary\n\n`hi.summary` is what `hsstore inspect STORE --json` prints; it verifies the "
        "store first (checksums), and a damaged shard would be named here and left out of everything below."
    ),
    new_code_cell(
        "from hsstore import inspect as hi\n\n"
        "report = hi.summary(store, tokenizer=\"auto\")  # tokens decoded with the tokenizer the lineage names\n"
        "print(hi.format_summary(report))"
    ),
    new_markdown_cell("## Samples\n\nOne row per sample; `decode_text=True` decodes with the lineage's tokenizer."),
    new_code_cell(
        "samples = hi.samples_frame(store, decode_text=True)\n"
        "samples[[\"source_id\", \"num_tokens\", \"num_loss_tokens\", \"loss_fraction\", \"text\"]].head(8)"
    ),
    new_code_cell(
        "histogram = hi.length_histogram(store, bins=16)\n"
        "hi.plot_length_histogram(histogram, PLOTS_DIR / \"length_histogram.png\")\n"
        "display(Image(filename=PLOTS_DIR / \"length_histogram.png\"))\n"
        "hi.loss_mask_coverage(store)"
    ),
    new_code_cell(
        "frequency = hi.token_frequency(store, top=None, tokenizer=\"auto\")\n"
        "print(\"a draft vocabulary of N ids covers:\", hi.vocab_coverage(frequency))\n"
        "hi.plot_token_frequency(frequency, PLOTS_DIR / \"token_frequency.png\")\n"
        "display(Image(filename=PLOTS_DIR / \"token_frequency.png\"))\n"
        "frequency.head(15)"
    ),
    new_markdown_cell(
        "## Hidden states per layer\n\n`h<i>` is aux layer id `i` (the state entering decoder layer `i`, "
        "`hidden_states[i]` in transformers); `final` is the post-norm final state. Heavy tails (kurtosis, "
        "values beyond 6 sigma, one channel's RMS far above the median) are what makes low-precision codecs lossy."
    ),
    new_code_cell(
        "stats = hi.layer_stats(store, max_tokens=4096)\n"
        "hi.plot_layer_stats(stats, PLOTS_DIR / \"layer_stats.png\")\n"
        "display(Image(filename=PLOTS_DIR / \"layer_stats.png\"))\n"
        "stats"
    ),
    new_markdown_cell("## One sample, token by token"),
    new_code_cell(
        "index = int(samples[\"num_loss_tokens\"].idxmax())  # the sample with the most trained-on tokens\n"
        "tokens = hi.token_frame(store, index)\n"
        "hi.plot_token_view(tokens, PLOTS_DIR / \"token_view.png\")\n"
        "display(Image(filename=PLOTS_DIR / \"token_view.png\"))\n"
        "tokens.head(20)"
    ),
    new_markdown_cell(
        "## bf16 against fp8\n\n"
        "Set `FP8_STORE` to compare with an fp8 extraction of the same data. Without it, the bf16 store is "
        "re-encoded with the `fp8_e4m3` codec: extraction encodes the target's bf16 outputs the same way, so "
        "this is exactly the codec's error. `compare_stores` matches samples by `sample_id` and checks their tokens agree."
    ),
    new_code_cell(
        "import shutil\n\n"
        "FP8_STORE = os.environ.get(\"FP8_STORE\")\n"
        "if FP8_STORE is None:\n"
        "    FP8_STORE = str(WORK_DIR / \"reference-store-fp8\")\n"
        "    shutil.rmtree(FP8_STORE, ignore_errors=True)  # rebuilt from the bf16 store each run\n"
        "    specs = [spec.model_copy(update={\"codec\": \"fp8_e4m3\"}) for spec in store.features.values()]\n"
        "    with hsstore.StoreWriter(FP8_STORE, specs, store.lineage) as writer:\n"
        "        for i in range(store.num_samples):\n"
        "            sample = store.read_sample(i, as_numpy=True)  # bf16 decodes to float32 exactly\n"
        "            writer.add_sample(\n"
        "                sample_id=sample[\"sample_id\"], source_id=sample[\"source_id\"],\n"
        "                input_ids=sample[\"input_ids\"], loss_mask=sample[\"loss_mask\"],\n"
        "                features={name: sample[name] for name in store.features},\n"
        "            )\n"
        "fp8 = hsstore.open_store(FP8_STORE)\n"
        "print(f\"bytes/token: bf16 {store.info()['bytes_per_token']:,.0f}, fp8 {fp8.info()['bytes_per_token']:,.0f}\")\n"
        "comparison = hi.compare_stores(store, fp8)\n"
        "hi.plot_comparison(comparison, PLOTS_DIR / \"bf16_vs_fp8.png\")\n"
        "display(Image(filename=PLOTS_DIR / \"bf16_vs_fp8.png\"))\n"
        "comparison"
    ),
    new_markdown_cell("## Every standard plot at once\n\nWhat `hsstore inspect STORE --plots DIR` writes."),
    new_code_cell(
        "paths = hi.write_plots(store, PLOTS_DIR / \"inspect\")\n"
        "sorted(str(p) for p in paths.values())"
    ),
]

SWEEP_CELLS = [
    new_markdown_cell(
        "# Sweep results\n\n"
        "Many drafts from one store: a results table and the metric against each swept key. Set "
        "`SWEEP_DIR` to a finished sweep's `output_dir` to read it; without it the notebook runs a tiny "
        "sweep (EAGLE-4 drafts for two unroll depths, a candidate head of two ranks on each) on `STORE`, "
        "or on a small store it extracts from the in-repo reference target. Rerunning resumes: finished "
        "points are skipped."
    ),
    new_code_cell(SETUP),
    new_code_cell(
        "SWEEP_DIR = os.environ.get(\"SWEEP_DIR\")\n"
        "if SWEEP_DIR is None:\n"
        "    print(\"no SWEEP_DIR: running a tiny sweep\")"
    ),
    new_code_cell(
        # The store is only needed to run a sweep (the trailing display of `store` is dropped).
        "if SWEEP_DIR is None:\n" + "\n".join("    " + line if line else "" for line in MAKE_STORE.splitlines()[:-1])
    ),
    new_code_cell(
        "if SWEEP_DIR is None:\n"
        "    from pipelines.sweep import load_sweep_recipe, run_sweep\n"
        "    from pipelines.sweep.recipe import SweepRecipe\n\n"
        "    SWEEP_DIR = str(WORK_DIR / \"sweep\")\n"
        "    # The reference sweep's recipes, shrunk: a few steps on short packed rows.\n"
        "    reference = load_sweep_recipe(\"recipes/reference/sweep.yaml\")\n"
        "    tiny = {\n"
        "        \"store\": STORE, \"max_steps\": 2, \"device\": \"cpu\", \"verify_weights\": False,\n"
        "        \"draft.intermediate_size\": 256, \"draft.vocab.draft_vocab_size\": 512,\n"
        "        \"loader.token_budget\": 256, \"loader.long_samples\": \"truncate\", \"schedule.warmup_steps\": 1,\n"
        "        \"log_every\": 1, \"checkpoint_every\": None,\n"
        "    }\n"
        "    recipe = SweepRecipe.model_validate({\n"
        "        **reference.model_dump(), \"overrides\": tiny, \"output_dir\": SWEEP_DIR,\n"
        "        \"evaluate\": None, \"metric\": \"recall_0\",  # the reference sweep also decodes with each point: minutes on a CPU\n"
        "        \"grid\": {\"ttt_length\": [2, 3], \"candidate_head.rank\": [8, 32]},\n"
        "    })\n"
        "    report = run_sweep(recipe)\n"
        "    print(f\"ran {len(report.ran)} points, {len(report.skipped)} finished before, {len(report.failed)} failed\")"
    ),
    new_markdown_cell("## The results table\n\n`results.parquet` (and `.csv`): one row per point, failed ones with their error."),
    new_code_cell(
        "import pandas as pd\n\n"
        "results = pd.read_parquet(Path(SWEEP_DIR) / \"results.parquet\")\n"
        "done = results[results[\"status\"] == \"done\"]\n"
        "print(f\"{len(done)} of {len(results)} points done\")\n"
        "results"
    ),
    new_code_cell(
        "import yaml\n\n"
        "sweep_recipe = yaml.safe_load((Path(SWEEP_DIR) / \"sweep.yaml\").read_text())\n"
        "keys = list(sweep_recipe[\"grid\"])\n"
        "metric = sweep_recipe.get(\"metric\") or (\"recall_0\" if \"recall_0\" in done else \"acc_0\")\n"
        "print(\"swept:\", keys, \"| metric:\", metric)\n"
        "done.pivot_table(index=keys[0], columns=keys[1:] or None, values=metric) if len(keys) > 1 else done.set_index(keys[0])[metric]"
    ),
    new_markdown_cell("## The metric against each swept key\n\nThe PNGs the sweep wrote under `plots/`."),
    new_code_cell(
        "sweep_plots = sorted((Path(SWEEP_DIR) / \"plots\").glob(\"*.png\"))\n"
        "for path in sweep_plots:\n"
        "    display(Image(filename=path))\n"
        "[p.name for p in sweep_plots]"
    ),
    new_markdown_cell(
        "## Per-depth accuracy of each point\n\n`acc_i` is the stage-1 draft's top-1 agreement with the "
        "target at unroll depth `i` (the offline proxy for acceptance); `recall_i` the candidate head's recall@K."
    ),
    new_code_cell(
        "from matplotlib.figure import Figure\n\n"
        "fig = Figure(figsize=(9, 3.6), layout=\"constrained\")\n"
        "axes = fig.subplots(1, 2)\n"
        "for ax, family in zip(axes, (\"acc\", \"recall\"), strict=True):\n"
        "    columns = sorted((c for c in done if c.startswith(family + \"_\") and c.split(\"_\")[-1].isdigit()), key=lambda c: int(c.split(\"_\")[-1]))\n"
        "    for _, row in done.iterrows():\n"
        "        values = row[columns].dropna().astype(float)\n"
        "        ax.plot(range(len(values)), values, marker=\"o\", label=\", \".join(f\"{k.split('.')[-1]}={row[k]}\" for k in keys))\n"
        "    ax.set(xlabel=\"depth\", ylabel=family, title=f\"{family} per depth\")\n"
        "axes[0].legend(fontsize=\"x-small\")\n"
        "fig.savefig(PLOTS_DIR / \"per_depth.png\", dpi=100)\n"
        "display(Image(filename=PLOTS_DIR / \"per_depth.png\"))"
    ),
]


def build(cells: list) -> nbformat.NotebookNode:
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    # Stable cell ids keep regenerated notebooks diff-free.
    for i, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{i:02d}"
    return notebook


NOTEBOOKS = {"01_inspect_store.ipynb": INSPECT_CELLS, "02_sweep_results.ipynb": SWEEP_CELLS}


def render(name: str) -> str:
    return nbformat.writes(build(NOTEBOOKS[name])) + "\n"


def main() -> int:
    for name in NOTEBOOKS:
        (HERE / name).write_text(render(name))
        print("wrote", HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
