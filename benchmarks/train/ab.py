"""The trainer before and after a change, side by side: speed and what is learned.

Both trees train the same recipe (same store, seed, steps, so the same samples in the same order)
on the reference target, alternating runs (baseline, current, baseline, current, ...) so that a
busy machine slows both alike; then the current tree's TTT code measures every checkpoint's
per-depth accuracy on a held-out store. Speed must not change what is learned.

    git worktree add /tmp/baseline <commit>
    python -m benchmarks.bench_train ab --baseline /tmp/baseline --out benchmarks/results/train-cpu-ab.json

Store: the first ``--records`` records of the training data, extracted once by the current tree
(the format is byte-identical across these versions: tests/data golden stores); the next
``--held-out`` records form the held-out store.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_train import (
    REFERENCE_TARGET,
    TRAIN_DATA,
    extract_reference,
    held_out_accuracy,
)
from benchmarks.common import REPO_ROOT, write_results

TRAIN = """
import json, sys
from pipelines.train.config import TrainRecipe
from pipelines.train.trainer import run_training
summary = run_training(TrainRecipe.model_validate_json(sys.argv[1]))
print("SUMMARY " + json.dumps(summary))
"""


def train(tree: Path, recipe: dict[str, Any], threads: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", TRAIN, json.dumps(recipe)], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"training in {tree} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY "))
    return json.loads(line[len("SUMMARY "):])


def readable_by_older(store: Path) -> None:
    """Drop the manifest's optional per-sample lengths (``ShardRecord.sample_tokens``, added after
    the first release; readers without it read the sample tables instead), which an older
    hsstore's manifest model refuses as an unknown field."""
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    for shard in manifest["shards"]:
        shard.pop("sample_tokens", None)
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a checkout of the baseline commit")
    parser.add_argument("--records", type=int, default=120)
    parser.add_argument("--held-out", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2, help="runs per tree (alternating)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="train-ab-"))
    store, held_out = workdir / "train-store", workdir / "held-out"
    if not store.exists():
        extract_reference(store, TRAIN_DATA, args.records, args.max_length, "bf16", "cpu")
    if not held_out.exists():
        extract_reference(held_out, TRAIN_DATA, args.held_out, args.max_length, "bf16", "cpu", skip=args.records)
    for path in (store, held_out):
        readable_by_older(path)
    trees = {"baseline": Path(args.baseline).resolve(), "current": REPO_ROOT}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in trees.items():
            out = workdir / f"{name}-{repeat}"
            recipe = {
                "store": str(store), "target": str(REFERENCE_TARGET), "output_dir": str(out), "device": "cpu",
                "max_steps": args.steps, "draft": {"vocab": {"draft_vocab_size": 2048}},
                "loader": {"token_budget": 2 * args.max_length, "shuffle_window": 256},
                "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 10}, "log_every": 10, "seed": 0,
                "resume": False, "verify_weights": False,
            }
            summary = train(tree, recipe, args.threads)
            runs[name].append({"tokens_per_s": summary["tokens_per_s"], "tokens": summary["tokens"],
                               "final_loss": summary["final_loss"], "checkpoint": summary["checkpoint"]})
            print(f"{name} run {repeat}: {summary['tokens_per_s']:.0f} tokens/s, loss {summary['final_loss']:.4f}",
                  flush=True)
    results: dict[str, Any] = {"settings": vars(args), "trees": {k: str(v) for k, v in trees.items()}}
    for name, rows in runs.items():
        acc = held_out_accuracy(Path(rows[0]["checkpoint"]), held_out, 2 * args.max_length, torch.device("cpu"))
        results[name] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
            "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in rows],
            "train_tokens": rows[0]["tokens"], "final_loss": rows[0]["final_loss"], "held_out_acc": acc,
        }
    base, cur = results["baseline"], results["current"]
    results["speed_ratio"] = cur["tokens_per_s_median"] / base["tokens_per_s_median"]
    results["held_out_acc_delta"] = [round(c - b, 4) for c, b in zip(cur["held_out_acc"], base["held_out_acc"], strict=True)]
    print(f"| tree | tokens/s (median of {args.repeats}) | training tokens | final loss | held-out acc depth 0..6 |")
    print("|---|---:|---:|---:|---|")
    for name in ("baseline", "current"):
        r = results[name]
        print(f"| {name} | {r['tokens_per_s_median']:.0f} | {r['train_tokens']:,} | {r['final_loss']:.4f} | "
              + " ".join(f"{a:.3f}" for a in r["held_out_acc"]) + " |")
    print(f"speed ratio current/baseline: {results['speed_ratio']:.2f}x")
    if args.out:
        write_results(args.out, results)
    return 0

