"""hsstore's EAGLE-3 trainer side by side with SpecForge's, on the same features (issue 27).

One run trains the same draft twice per seed from the same features: once with ``hsstore train``
streaming the store, once with SpecForge 0.2.0's own offline trainer reading the same samples
written by ``hsstore export-features --format specforge`` (bit-exact). Both get hsstore's export
``config.json`` as the draft config, the same draft vocabulary (SpecForge is handed hsstore's
``d2t``/``t2d``), the same learning rate, warmup + cosine schedule, TTT length 7, tokens per step
and number of steps. Then both drafts are evaluated by ``hsstore evaluate`` (SpecForge's export
loads through ``load_draft``) on the same held-out prompts and a held-out store:

- per-depth held-out accuracy (the offline proxy on a store extracted from records neither
  trainer saw: a stable 10% of the records by a hash of their id),
- acceptance length: chain of 5 and tree 8/5/31 at temperature 0, tree at temperature 1,
- training tokens/s (real tokens, I/O included: SpecForge reads its files, hsstore its store).

Modes:

    python benchmarks/bench_vs_specforge.py reference --device cuda --steps 1000 --section reference_gpu
    python benchmarks/bench_vs_specforge.py reference --device cpu --steps 200 --max-length 512 \
        --token-budget 1024 --section reference_cpu
    python benchmarks/bench_vs_specforge.py qwen3-8b --device cuda --steps 30     # speed only

``--out`` (default benchmarks/results/vs-specforge.json) is updated in place: only ``--section``'s
key is replaced. SpecForge runs as a user would run it, in a subprocess; what it needs on a CPU
(an eager loss instead of its Triton kernel, no FSDP sharding) is a shim in
``benchmarks/specforge_peer.py``, stated there. It is installed with
``pip install --no-deps specforge==0.2.0`` (it pins torch and sglang, which its offline path does
not import); its other imports are listed in that module's docstring.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

REFERENCE_TARGET = REPO / "examples" / "reference-target"
SHARED_DATA = REPO.parent / "shared" / "data"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "vs-specforge.json"
HELDOUT_FRACTION = 0.1
REFERENCE_AUX = [2, 4, 5]


# -- data and stores ---------------------------------------------------------------------------


def split_records(source: Path, workdir: Path, fraction: float = HELDOUT_FRACTION) -> tuple[Path, Path]:
    """Train and held-out JSONL files: a record is held out when sha256(id) falls in ``fraction``
    (stable, whatever the file order)."""
    train, heldout = workdir / "train.jsonl", workdir / "heldout.jsonl"
    with source.open() as src, train.open("w") as tr, heldout.open("w") as ho:
        for line in src:
            if not line.strip():
                continue
            record_id = str(json.loads(line).get("id"))
            digest = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
            (ho if digest < fraction * 2**64 else tr).write(line)
    return train, heldout


def extract(records: Path, store: Path, target: Path, device: str, max_length: int) -> str:
    """The project's extraction in process (no Ray needed on the GPU machine)."""
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    if (store / "manifest.json").exists():
        return str(store)
    recipe = build_recipe(
        ExtractRecipe,
        {
            "target": str(target),
            "data": [str(records)],
            "store": str(store),
            "executor": "local",
            "model": {"dtype": "bfloat16" if device.startswith("cuda") else "float32", "device": device},
            "capture": {"aux_layer_ids": REFERENCE_AUX},
            "batching": {"max_length": max_length, "too_long": "truncate", "token_budget": 16384},
            "units": {"max_tokens": 131072},
        },
    )
    run_extraction(recipe)
    return str(store)


# -- the two trainers --------------------------------------------------------------------------


def hyperparameters(args: argparse.Namespace) -> dict[str, Any]:
    """What both trainers are given."""
    return {
        "steps": args.steps,
        "lr": args.lr,
        "warmup_steps": max(1, args.steps // 20),
        "min_lr_ratio": 0.1,
        "betas": (0.9, 0.95),
        "weight_decay": 0.0,
        "grad_clip": 0.5,
        "ttt_length": 7,
        "token_budget": args.token_budget,
    }


def train_hsstore(store: str, target: Path, out: Path, seed: int, hp: dict[str, Any], device: str) -> dict[str, Any]:
    from pipelines.recipe import build_recipe
    from pipelines.train.config import TrainRecipe
    from pipelines.train.trainer import run_training

    recipe = build_recipe(
        TrainRecipe,
        {
            "store": store,
            "target": str(target),
            "output_dir": str(out),
            "max_steps": hp["steps"],
            "draft": {"vocab": {"draft_vocab_size": 2048}},
            "ttt_length": hp["ttt_length"],
            "optimizer": {"lr": hp["lr"], "betas": list(hp["betas"]), "weight_decay": hp["weight_decay"], "grad_clip": hp["grad_clip"]},
            "schedule": {"warmup_steps": hp["warmup_steps"], "min_lr_ratio": hp["min_lr_ratio"]},
            "loader": {"token_budget": hp["token_budget"], "rows_per_batch": 1, "long_samples": "truncate"},
            "seed": seed,
            "device": device,
            "resume": False,
            "log_every": 50,
            "verify_weights": False,
        },
    )
    began = time.perf_counter()
    summary = run_training(recipe)
    summary["process_wall_s"] = time.perf_counter() - began
    return summary


def export_eagle3(run_dir: Path, out: Path) -> Path:
    from pipelines.export.serving import export_draft

    if (out / "config.json").exists():
        return out
    return export_draft(run_dir, "eagle3", out, dtype="float32", include_embed_tokens=False)


# -- evaluation --------------------------------------------------------------------------------


def evaluate(draft: Path, heldout_store: str, prompts: Path, target: Path, device: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from pipelines.evaluate.recipe import EvaluateRecipe
    from pipelines.evaluate.runner import run_evaluation
    from pipelines.recipe import build_recipe

    recipe = build_recipe(
        EvaluateRecipe,
        {
            "target": str(target),
            "draft": str(draft),
            "prompts": str(prompts),
            "output_dir": str(out),
            "limit": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "settings": [
                {"name": "chain5_t0", "num_draft_tokens": 5},
                {"name": "tree_t0", "draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31},
                {"name": "tree_t1", "draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31, "temperature": 1.0},
            ],
            "dtype": "float32",
            "device": device,
            "baseline": False,
            "seed": 0,
            "proxy": {"store": heldout_store, "fraction": 1.0, "max_samples": args.heldout_samples, "ttt_length": 7},
        },
    )
    results = run_evaluation(recipe)
    al = {s["name"]: s["acceptance_length"] for s in results["settings"]}
    return {
        "heldout_acc": results["offline_proxy"]["accuracy_per_depth"],
        "al_chain5_t0": al["chain5_t0"],
        "al_tree_t0": al["tree_t0"],
        "al_tree_t1": al["tree_t1"],
    }


# -- aggregation -------------------------------------------------------------------------------


def median_and_spread(values: list[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds, the spread [min, max] beside each, and every run kept."""
    out: dict[str, Any] = {}
    for key in ("al_chain5_t0", "al_tree_t0", "al_tree_t1", "tokens_per_s"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key], out[f"{key}_spread"] = median_and_spread(values)
    depths = len(runs[0]["heldout_acc"])
    out["heldout_acc"] = [statistics.median(r["heldout_acc"][d] for r in runs) for d in range(depths)]
    out["heldout_acc_spread"] = [[min(r["heldout_acc"][d] for r in runs), max(r["heldout_acc"][d] for r in runs)] for d in range(depths)]
    out["runs"] = runs
    return out


def verdicts(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The issue's aims, judged from the medians and the seeds' spread."""
    ours_tree, theirs_tree = ours["al_tree_t0"], theirs["al_tree_t0"]
    spread = max(ours["al_tree_t0_spread"][1] - ours["al_tree_t0_spread"][0], theirs["al_tree_t0_spread"][1] - theirs["al_tree_t0_spread"][0])
    if ours_tree >= theirs_tree:
        tree = "met"
    elif theirs_tree - ours_tree <= spread:
        tree = "tie (within the seeds' spread)"
    else:
        tree = "not met"
    acc0 = ours["heldout_acc"][0] / theirs["heldout_acc"][0] - 1
    return {
        "al_tree_t0_ratio": ours_tree / theirs_tree,
        "al_tree_t0": tree,
        "heldout_acc0_rel_delta": acc0,
        "heldout_acc0": "met" if acc0 >= -0.01 else "not met",
    }


# -- modes -------------------------------------------------------------------------------------


def run_reference(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.specforge_peer import train_specforge
    from pipelines.export.features import export_features

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else (SHARED_DATA / "draft_train.jsonl" if (SHARED_DATA / "draft_train.jsonl").exists() else REPO / "examples" / "data" / "draft_train_slice.jsonl")
    prompts = Path(args.eval_prompts) if args.eval_prompts else (SHARED_DATA / "eval_prompts.jsonl" if (SHARED_DATA / "eval_prompts.jsonl").exists() else REPO / "examples" / "data" / "eval_prompts.jsonl")
    target = Path(args.target)
    train_jsonl, heldout_jsonl = split_records(data, work)
    t0 = time.perf_counter()
    train_store = extract(train_jsonl, work / "train-store", target, args.device, args.max_length)
    heldout_store = extract(heldout_jsonl, work / "heldout-store", target, args.device, args.max_length)
    print(f"stores ready in {time.perf_counter() - t0:.0f} s", flush=True)
    hp = hyperparameters(args)
    features = work / "specforge-features"
    if not (features / "hsstore-export.json").exists():
        export_features(train_store, features, "specforge", overwrite=True)

    results: dict[str, list[dict[str, Any]]] = {"hsstore": [], "specforge": []}
    vocab_source: Path | None = None
    for seed in args.seeds:
        run_dir = work / f"hsstore-seed{seed}"
        summary = train_hsstore(train_store, target, run_dir, seed, hp, args.device)
        export = export_eagle3(run_dir, work / f"hsstore-seed{seed}-export")
        vocab_source = vocab_source or export
        print(f"hsstore seed {seed}: {summary['tokens_per_s']:.0f} tok/s, loss {summary['final_loss']}", flush=True)
        scores = evaluate(export, heldout_store, prompts, target, args.eval_device, args, work / f"eval-hsstore-{seed}")
        results["hsstore"].append({"seed": seed, "tokens_per_s": summary["tokens_per_s"], "train_wall_s": summary["wall_s"], "final_loss": summary["final_loss"], **scores})
        print(json.dumps(results["hsstore"][-1]), flush=True)
    assert vocab_source is not None
    for seed in args.seeds:
        sf = train_specforge(
            features, vocab_source / "config.json", vocab_source, target, work / f"specforge-seed{seed}",
            steps=hp["steps"], lr=hp["lr"], warmup_steps=hp["warmup_steps"], min_lr_ratio=hp["min_lr_ratio"],
            ttt_length=hp["ttt_length"], max_len=args.max_length, batch_size=1, token_budget=hp["token_budget"],
            seed=seed, device=args.device, grad_clip=hp["grad_clip"], betas=hp["betas"], weight_decay=hp["weight_decay"],
        )
        print(f"specforge seed {seed}: {sf['tokens_per_s']:.0f} tok/s", flush=True)
        scores = evaluate(Path(sf["export_dir"]), heldout_store, prompts, target, args.eval_device, args, work / f"eval-specforge-{seed}")
        results["specforge"].append({"seed": seed, "tokens_per_s": sf["tokens_per_s"], "train_wall_s": sf.get("train_seconds"), "final_loss": sf.get("final_loss"), **scores})
        print(json.dumps(results["specforge"][-1]), flush=True)
    ours, theirs = aggregate(results["hsstore"]), aggregate(results["specforge"])
    return {
        "steps": args.steps,
        "seeds": len(args.seeds),
        "hyperparameters": {k: list(v) if isinstance(v, tuple) else v for k, v in hp.items()},
        "train_records": sum(1 for _ in train_jsonl.open()),
        "heldout_records": sum(1 for _ in heldout_jsonl.open()),
        "max_length": args.max_length,
        "eval_prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "hsstore": ours,
        "specforge": theirs,
        "verdicts": verdicts(ours, theirs),
    }


def machine() -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_section(out: Path, section: str, result: dict[str, Any]) -> None:
    data = json.loads(out.read_text()) if out.exists() else {}
    result["machine"] = machine()
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    data[section] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("reference", "qwen3-8b"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eval-device", default=None, help="where drafts are evaluated (default: --device)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--token-budget", type=int, default=4096, help="tokens per step (packed row)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=50, help="held-out prompts decoded per draft")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--heldout-samples", type=int, default=64)
    parser.add_argument("--data", default=None)
    parser.add_argument("--eval-prompts", default=None)
    parser.add_argument("--target", default=str(REFERENCE_TARGET))
    parser.add_argument("--workdir", default="/tmp/bench-vs-specforge")
    parser.add_argument("--section", default=None, help="key of the results file to write (default by mode and device)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    args.eval_device = args.eval_device or args.device
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "reference":
        result = run_reference(args)
        section = args.section or ("reference_gpu" if args.device.startswith("cuda") else "reference_cpu")
    else:
        from benchmarks.vs_specforge_speed import run_speed

        result = run_speed(args)
        section = args.section or "qwen3_8b_shape_gpu"
    write_section(Path(args.out), section, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("hsstore", "specforge")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
