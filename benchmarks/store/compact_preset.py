"""The compact preset vs bf16 on the reference target at equal training tokens (issue 15), CPU.

One run, side by side, every step the project's own jobs:

1. **Extract** the same training records twice with the reference target: ``bf16`` (aux bf16 + the
   final state in bf16, the trainer rebuilding exact logits) and ``compact``
   (recipes/reference/extract-compact.yaml's codecs: aux fp8_e4m3 + zstd, the top-k teacher in bf16
   + zstd, no final state); and a held-out store (bf16) of records neither draft trains on.
2. **Train** one EAGLE-3 draft per store with the same recipe, seed and step count (the test suite's
   small draft: MLP 512, draft vocabulary 1,024; rows of 2 x 256 tokens): same sample lengths, so
   the same packing plan and exactly the same training tokens.
3. **Evaluate** both by really decoding against the target (chain 5 and tree 8/5/31, greedy and
   temperature 1) on the same prompts, and score held-out per-depth accuracy on the held-out store
   (the evaluation's offline proxy).

``*_rel_delta`` = (compact - bf16) / bf16, averaged over depths / settings, as the issue defines.
Small by necessity on a shared 2-core machine (see ``--help`` for the sizes; RESULTS.md says what
was run). Usage: ``python -m benchmarks.bench_store compact-preset [--quick] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, write_results

TARGET = REPO_ROOT / "examples" / "reference-target"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data" / "draft_train.jsonl"
SLICE_DATA = REPO_ROOT / "examples" / "data" / "draft_train_slice.jsonl"
PROMPTS = REPO_ROOT / "examples" / "data" / "eval_prompts.jsonl"

CODECS = {
    "bf16": {
        "capture": {"aux_layer_ids": [2, 4, 5], "final_hidden_state": True, "target_distribution": "final_hidden"},
        "codecs": {"aux_hidden_states": {"codec": "bf16"}, "final_hidden_state": {"codec": "bf16"}},
    },
    "compact": {  # recipes/reference/extract-compact.yaml
        "capture": {"aux_layer_ids": [2, 4, 5], "final_hidden_state": False, "target_distribution": "topk", "topk_k": 20},
        "codecs": {"aux_hidden_states": {"codec": "fp8_e4m3", "compression": "zstd"}, "topk_logits": {"codec": "bf16", "compression": "zstd"}},
    },
}
SETTINGS = [
    {"name": "chain5_greedy", "num_draft_tokens": 5},
    {"name": "tree8-5-31_greedy", "draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31},
    {"name": "chain5_t1", "num_draft_tokens": 5, "temperature": 1.0},
    {"name": "tree8-5-31_t1", "draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31, "temperature": 1.0},
]


def split_records(source: Path, workdir: Path, num_train: int, num_heldout: int) -> tuple[Path, Path]:
    lines = source.read_text().splitlines()
    if len(lines) < num_train + num_heldout:
        raise SystemExit(f"{source} has {len(lines)} records, fewer than {num_train} + {num_heldout}")
    train, heldout = workdir / "train.jsonl", workdir / "heldout.jsonl"
    train.write_text("\n".join(lines[:num_train]) + "\n")
    heldout.write_text("\n".join(lines[num_train : num_train + num_heldout]) + "\n")
    return train, heldout


def extract(store: Path, data: Path, variant: str, max_length: int) -> None:
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    run_extraction(build_recipe(ExtractRecipe, {
        "target": str(TARGET), "data": [str(data)], "store": str(store), "executor": "local",
        "model": {"dtype": "float32", "device": "cpu"},  # CPU bf16 matmuls are several times slower
        **CODECS[variant],
        "batching": {"max_length": max_length, "too_long": "truncate", "token_budget": 4096},
        "units": {"max_tokens": 1 << 20},
    }))


def train(store: Path, output_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pipelines.train import TrainRecipe, run_training

    return run_training(TrainRecipe.model_validate({
        "store": str(store), "target": str(TARGET), "output_dir": str(output_dir), "max_steps": args.steps,
        # The test suite's small draft (narrower MLP, 1k draft vocab): a shared 2-core CPU.
        "draft": {"intermediate_size": 512, "vocab": {"draft_vocab_size": 1024}},
        "loader": {"token_budget": args.token_budget, "rows_per_batch": 2, "shuffle_window": 256, "read_threads": 2},
        "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 20},
        "log_every": 10, "device": "cpu", "seed": 0, "resume": False,
    }))


def evaluate(checkpoint: str, heldout: Path, output_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pipelines.evaluate.recipe import EvaluateRecipe
    from pipelines.evaluate.runner import run_evaluation

    return run_evaluation(EvaluateRecipe.model_validate({
        "target": str(TARGET), "draft": checkpoint, "prompts": str(PROMPTS), "output_dir": str(output_dir),
        "limit": args.prompts, "max_new_tokens": args.max_new_tokens, "settings": SETTINGS,
        "dtype": "float32", "device": "cpu", "seed": 0, "baseline": False,
        "proxy": {"store": str(heldout), "fraction": 1.0, "max_samples": args.heldout_samples, "ttt_length": 7},
    }))


def rel_delta(ours: list[float], base: list[float]) -> float:
    pairs = [(o, b) for o, b in zip(ours, base, strict=True) if o is not None and b]
    return statistics.mean((o - b) / b for o, b in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-records", type=int, default=240)
    parser.add_argument("--heldout-records", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--heldout-samples", type=int, default=40)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.train_records, args.heldout_records, args.max_length, args.steps = 12, 4, 128, 4
        args.token_budget, args.prompts, args.max_new_tokens, args.heldout_samples = 256, 2, 8, 4
    source = SHARED_DATA if SHARED_DATA.exists() else SLICE_DATA
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-compact-preset-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report: dict[str, Any] = {
        "command": " ".join(["bench_compact_preset.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "data": str(source), "sizes": {k: v for k, v in vars(args).items() if k not in ("workdir", "out", "quick")},
        "variants": {},
    }
    try:
        train_data, heldout_data = split_records(source, workdir, args.train_records, args.heldout_records)
        extract(workdir / "heldout", heldout_data, "bf16", args.max_length)
        for variant in CODECS:
            store = workdir / f"store-{variant}"
            extract(store, train_data, variant, args.max_length)
            summary = train(store, workdir / f"train-{variant}", args)
            results = evaluate(summary["checkpoint"], workdir / "heldout", workdir / f"eval-{variant}", args)
            import hsstore

            info = hsstore.open_store(str(store)).info()
            report["variants"][variant] = {
                "store_bytes_per_token": info["bytes_per_token"],
                "features": {k: v["bytes_per_token"] for k, v in info["features"].items()},
                "train_tokens": summary["tokens"], "train_steps": summary["steps"], "final_loss": summary["final_loss"],
                "heldout_accuracy_per_depth": results["offline_proxy"]["accuracy_per_depth"],
                "acceptance_length": {s["name"]: s["acceptance_length"] for s in results["settings"]},
            }
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    base, compact = report["variants"]["bf16"], report["variants"]["compact"]
    report["equal_training_tokens"] = base["train_tokens"] == compact["train_tokens"]
    report["heldout_accuracy_rel_delta"] = round(rel_delta(compact["heldout_accuracy_per_depth"], base["heldout_accuracy_per_depth"]), 5)
    names = list(base["acceptance_length"])
    report["acceptance_length_rel_delta"] = round(rel_delta([compact["acceptance_length"][n] for n in names], [base["acceptance_length"][n] for n in names]), 5)
    report["wall_s"] = round(time.time() - started)
    print(f"\ntraining tokens: bf16 {base['train_tokens']:,}, compact {compact['train_tokens']:,} (equal: {report['equal_training_tokens']})")
    print("\n| store | bytes/token (H=384) | " + " | ".join(f"acc@{d}" for d in range(7)) + " | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * 7 + "---:|" * len(names))
    for variant, entry in report["variants"].items():
        accs = " | ".join("-" if a is None else f"{a:.3f}" for a in entry["heldout_accuracy_per_depth"])
        als = " | ".join(f"{entry['acceptance_length'][n]:.3f}" for n in names)
        print(f"| {variant} | {entry['store_bytes_per_token']:,.0f} | {accs} | {als} |")
    print(f"\nheldout_accuracy_rel_delta {report['heldout_accuracy_rel_delta']:+.4f}, acceptance_length_rel_delta {report['acceptance_length_rel_delta']:+.4f}")
    if args.out:
        write_results(args.out, report)
    return 0

