"""Where planning's time goes before the first unit (issue 31's start): ``hsstore extract --dry-run``
over gpu-limit's workload (records of 1,024-2,048 words, a word-level tokenizer of the Qwen3-8B
vocabulary, the 8B shape's config; no weights: planning reads none), in fresh processes, with
planning's process pool at its default size and with none (``planning.num_workers: 1``), and one
run under cProfile.

    python -m benchmarks.investigations.profile_planning --work /tmp/plan --out OUT.json

In a job of about one sort window (4M tokens by default) the first unit is planned only once the
whole window is tokenized, so this is what the first forward waits for besides the model load.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT


def make_workload(work: Path, tokens: int) -> Path:
    from transformers import Qwen3Config

    from benchmarks.bench_extract import QWEN3_SHAPES
    from benchmarks.extract.through_ray import write_records, write_word_tokenizer

    target = work / "target"
    if not (target / "config.json").exists():
        Qwen3Config(tie_word_embeddings=False, **QWEN3_SHAPES["qwen3-8b"]).save_pretrained(target)
        write_word_tokenizer(target, QWEN3_SHAPES["qwen3-8b"]["vocab_size"])
    write_records(target, work / "records.jsonl", tokens, 1024, 2048)
    return target


def write_recipe(work: Path, num_workers: int | None) -> Path:
    import yaml

    recipe = {
        "target": str(work / "target"), "data": [str(work / "records.jsonl")], "store": str(work / "store"),
        "executor": "local", "model": {"device": "cpu"},
        "batching": {"max_length": 4096, "token_budget": 32768}, "units": {"max_tokens": 262144},
        "planning": {"num_workers": num_workers},
    }
    path = work / f"plan-{num_workers or 'default'}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def dry_run(recipe: Path) -> dict[str, Any]:
    """One ``hsstore extract --dry-run`` in its own process: its wall and the summary's split."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "extract", str(recipe), "--dry-run", "--json"],
                          cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    process_seconds = time.perf_counter() - start
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    return {"process_seconds": round(process_seconds, 2), "prepare_seconds": round(summary["prepare_seconds"], 2),
            "wall_seconds": round(summary["wall_seconds"], 2),
            "planning_seconds": round(summary["wall_seconds"] - summary["prepare_seconds"], 2),
            "num_samples": summary["num_samples"]}


def profiled(recipe: Path, lines: int) -> str:
    from pipelines.extract import run_extraction
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    profile = cProfile.Profile()
    profile.enable()
    run_extraction(load_recipe(ExtractRecipe, str(recipe), []), dry_run=True)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/hsstore-plan-profile")
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    make_workload(work, args.tokens)
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # interleaved: the machine's drift falls on both
        for workers in (None, 1):
            runs.setdefault(f"num_workers={workers or 'default'}", []).append(dry_run(write_recipe(work, workers)))
    result = {"tokens": args.tokens, "runs": runs, "profile_default": profiled(write_recipe(work, None), 45)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
