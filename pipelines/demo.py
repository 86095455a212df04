"""``hsstore demo``: the whole pipeline on the bundled reference target, in minutes, on a laptop.

Extract the reference target's features for a slice of the bundled data into a store, train an
EAGLE-3 draft from the store (the target's transformer stack is never loaded for training), export
it in the vLLM/SGLang layout, evaluate the export with real speculative decoding against the
target, and print one table. Every step uses the same recipes a user runs
(``recipes/reference/*.yaml``) with ``--set``-style overrides, so the demo is also a worked example.

Rerunning with the same ``--workdir`` resumes: committed extraction units are skipped and training
continues from its newest checkpoint. ``--fresh`` starts over.

``--draft DIR`` skips the first three steps and evaluates a draft already exported, such as the
shipped ``examples/reference-draft`` (trained on the target's own answers: docs/generate.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = REPO_ROOT / "recipes" / "reference"
TARGET = REPO_ROOT / "examples" / "reference-target"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "draft_train_slice.jsonl"
EVAL_PROMPTS = REPO_ROOT / "examples" / "data" / "eval_prompts.jsonl"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "demo",
        help="extract -> train -> export -> evaluate on the bundled reference target (CPU, minutes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", default="runs/demo", help="where every artifact goes")
    parser.add_argument("--gpu", action="store_true", help="run every step on the GPU (bf16)")
    parser.add_argument("--records", type=int, default=160, help="training records to extract")
    parser.add_argument("--max-length", type=int, default=768, help="tokens kept per record")
    parser.add_argument("--train-steps", type=int, default=140, help="optimizer steps (rows of 2 x max-length tokens)")
    parser.add_argument("--prompts", type=int, default=10, help="evaluation prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--executor", choices=["ray", "local"], default="ray", help="extraction executor"
    )
    parser.add_argument("--fresh", action="store_true", help="delete --workdir first")
    parser.add_argument(
        "--draft",
        default=None,
        metavar="DIR",
        help="evaluate this exported draft (e.g. examples/reference-draft) instead of extracting and training one",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.draft is not None:
        results = run_draft_demo(
            Path(args.draft),
            workdir=Path(args.workdir),
            gpu=args.gpu,
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
        )
        print(format_table(results))
        return 0
    results = run_demo(
        workdir=Path(args.workdir),
        gpu=args.gpu,
        records=args.records,
        max_length=args.max_length,
        train_steps=args.train_steps,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        executor=args.executor,
        fresh=args.fresh,
    )
    print(format_table(results))
    return 0


def run_demo(
    *,
    workdir: Path,
    gpu: bool = False,
    records: int = 160,
    max_length: int = 768,
    train_steps: int = 140,
    prompts: int = 10,
    max_new_tokens: int = 48,
    executor: str = "ray",
    fresh: bool = False,
) -> dict[str, Any]:
    """Run the four steps and return what the table shows (also written to ``workdir/demo.json``)."""
    import hsstore
    from pipelines.evaluate import run_evaluation
    from pipelines.export.serving import export_draft

    if fresh and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if gpu else "cpu"
    # The CPU computes in float32 (bf16 matmuls are slow there and greedy checks want exactness);
    # the GPU in bf16 as a real deployment would. Stored features are bf16 either way.
    dtype = "bfloat16" if gpu else "float32"
    store_url = str(workdir / "store")
    timings: dict[str, float] = {}

    _banner("1/4 extract: the target runs once over the data")
    started = time.perf_counter()
    extraction = extract_step(store_url, records, max_length, executor, device, dtype)
    timings["extract_s"] = time.perf_counter() - started
    info = hsstore.open_store(store_url).info()

    _banner("2/4 train: an EAGLE-3 draft from the store (no target forward)")
    started = time.perf_counter()
    training = train_step(store_url, workdir / "eagle3", train_steps, max_length, device)
    timings["train_s"] = time.perf_counter() - started
    checkpoint = Path(training["checkpoint"])

    _banner("3/4 export: the vLLM/SGLang EAGLE-3 layout")
    export_dir = export_draft(checkpoint, "eagle3", workdir / "export-eagle3", overwrite=True)
    print(f"exported {checkpoint} -> {export_dir}")

    _banner("4/4 evaluate: real speculative decoding, the target verifies")
    started = time.perf_counter()
    evaluation = run_evaluation(
        evaluate_recipe(export_dir, workdir, prompts, max_new_tokens, gpu, [f"proxy.store={store_url}"])
    )
    timings["evaluate_s"] = time.perf_counter() - started

    results = {
        **_what_was_done(info, extraction, training, evaluation),
        "artifacts": {
            "store": store_url,
            "rejects": str(Path(store_url) / "rejects"),
            "checkpoint": str(checkpoint),
            "export": str(export_dir),
            "evaluation": str(workdir / "evaluate" / "evaluation_results.json"),
            "metrics": str(workdir / "eagle3" / "metrics.jsonl"),
        },
        "timings_s": timings,
        "device": device,
    }
    (workdir / "demo.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def _banner(name: str) -> None:
    print(f"\n== {name} " + "=" * max(0, 60 - len(name)), flush=True)


def extract_step(store_url: str, records: int, max_length: int, executor: str, device: str, dtype: str) -> Any:
    """``recipes/reference/extract.yaml`` over the first ``records`` of the bundled slice."""
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import load_recipe

    extract = load_recipe(
        ExtractRecipe,
        RECIPES / "extract.yaml",
        [
            f"target={TARGET}",
            f"data=[{TRAIN_DATA}]",
            f"store={store_url}",
            f"limit={records}",
            f"executor={executor}",
            f"model.device={device}",
            f"model.dtype={dtype}",
            f"batching.max_length={max_length}",
            f"batching.token_budget={8 * max_length}",
            f"units.max_tokens={16 * max_length}",
        ],
    )
    extraction = run_extraction(extract, progress=True)
    print(extraction.format())
    return extraction


def train_step(store_url: str, output_dir: Path, train_steps: int, max_length: int, device: str) -> dict[str, Any]:
    """``recipes/reference/train-eagle3.yaml`` on the store: rows of two records, a checkpoint halfway."""
    from pipelines.recipe import load_recipe
    from pipelines.train.config import TrainRecipe
    from pipelines.train.trainer import run_training

    train = load_recipe(
        TrainRecipe,
        RECIPES / "train-eagle3.yaml",
        [
            f"store={store_url}",
            f"target={TARGET}",
            f"output_dir={output_dir}",
            f"max_steps={train_steps}",
            f"loader.token_budget={2 * max_length}",
            "schedule.warmup_steps=10",
            f"device={device}",
            f"checkpoint_every={max(train_steps // 2, 1)}",
            "log_every=10",
        ],
    )
    return run_training(train)


def _what_was_done(
    info: dict[str, Any], extraction: Any, training: dict[str, Any], evaluation: dict[str, Any]
) -> dict[str, Any]:
    """The numbers the table shows: the store's size, each step's speed, each setting's acceptance."""
    return {
        "samples": info["num_samples"],
        "tokens": info["num_tokens"],
        "bytes_per_token": info["bytes_per_token"],
        "rejected": extraction.num_rejected,
        "extract_tokens_per_s": extraction.tokens_per_second,
        "train_steps": training["steps"],
        "train_tokens_per_s": training["tokens_per_s"],
        "train_final_acc": training["final_acc"],
        "settings": settings_summary(evaluation),
    }


def evaluate_recipe(
    draft: Path, workdir: Path, prompts: int, max_new_tokens: int, gpu: bool, extra: list[str]
) -> Any:
    """recipes/reference/evaluate.yaml for the demo: greedy chain of 5 and the Eaglet tree 8/5/31
    (the recipe's sampled setting is left to `hsstore evaluate` to keep the demo short)."""
    from pipelines.evaluate.recipe import EvaluateRecipe
    from pipelines.recipe import load_recipe

    return load_recipe(
        EvaluateRecipe,
        RECIPES / "evaluate.yaml",
        [
            f"target={TARGET}",
            f"draft={draft}",
            f"prompts={EVAL_PROMPTS}",
            f"output_dir={workdir / 'evaluate'}",
            f"limit={prompts}",
            f"max_new_tokens={max_new_tokens}",
            f"dtype={'bfloat16' if gpu else 'float32'}",
            f"device={'cuda' if gpu else 'cpu'}",
            "settings=[{num_draft_tokens: 5}, {draft_top_k: 8, draft_depth: 5, total_draft_tokens: 31}]",
            *extra,
        ],
    )


def run_draft_demo(
    draft: Path, *, workdir: Path, gpu: bool = False, prompts: int = 10, max_new_tokens: int = 48
) -> dict[str, Any]:
    """Step 4 alone, on a draft already exported: acceptance length and speedup against the target."""
    from pipelines.evaluate import run_evaluation

    if not (draft / "config.json").exists():
        raise FileNotFoundError(f"--draft {draft}: no config.json there (an exported eagle3/eagle4 draft folder)")
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"\n== evaluate {draft}: real speculative decoding, the target verifies", flush=True)
    started = time.perf_counter()
    # No proxy: the offline proxy reads the store the draft was trained on, which did not ship.
    evaluation = run_evaluation(evaluate_recipe(draft, workdir, prompts, max_new_tokens, gpu, ["proxy=null"]))
    results = {
        "settings": settings_summary(evaluation),
        "artifacts": {"draft": str(draft), "evaluation": str(workdir / "evaluate" / "evaluation_results.json")},
        "timings_s": {"evaluate_s": time.perf_counter() - started},
        "device": "cuda" if gpu else "cpu",
    }
    (workdir / "demo.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def settings_summary(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "name": s["name"],
            "acceptance_length": s["acceptance_length"],
            "speedup": s.get("speedup"),
            "greedy_agreement": s.get("greedy_agreement"),
        }
        for s in evaluation["settings"]
    ]


def format_table(results: dict[str, Any]) -> str:
    """The one table the demo prints."""
    rows = []
    if "samples" in results:  # a full demo (a --draft demo evaluates only)
        rows += [
            ("samples extracted", f"{results['samples']:,}"),
            ("tokens", f"{results['tokens']:,}"),
            ("store bytes/token", f"{results['bytes_per_token']:,.0f}"),
            ("extraction tokens/s", f"{results['extract_tokens_per_s']:,.0f}"),
            ("training steps", f"{results['train_steps']:,}"),
            ("training tokens/s", f"{results['train_tokens_per_s']:,.0f}"),
        ]
    if results.get("train_final_acc"):
        rows.append(("train acc by depth", " ".join(f"{a:.2f}" for a in results["train_final_acc"])))
    for setting in results["settings"]:
        rows.append((f"acceptance length, {setting['name']}", f"{setting['acceptance_length']:.2f}"))
        if setting.get("speedup"):
            rows.append((f"speedup, {setting['name']}", f"{setting['speedup']:.2f}x"))
    width = max(len(name) for name, _ in rows)
    lines = ["", f"hsstore demo ({results['device']})", "-" * (width + 20)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    lines += ["-" * (width + 20), "artifacts:"]
    lines += [f"  {name:<11} {path}" for name, path in results["artifacts"].items()]
    timings = results["timings_s"]
    lines.append(
        "time: " + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in timings.items())
    )
    return "\n".join(lines)
