"""The reference draft's ladder (issue 28): acceptance length of drafts trained at equal steps on
the raw records, on the target's greedy answers and on its temperature-1 answers.

Each rung's draft is an eagle3 export (``tools/gpu_reference_draft.sh train`` writes
``export-raw``, ``export-greedy`` and ``export-t1`` with the training's ``metrics.jsonl`` and the
store's ``hsstore info`` beside each). Every draft decodes the same held-out prompts
(``examples/data/eval_prompts.jsonl``: continuations of files reserved from training) against the
reference target in float32, with the same three settings: a chain of 5 and the EAGLE-2 tree
8/5/31 at temperature 0, and the tree at temperature 1 (lossless rejection sampling, seed 0).

    python -m benchmarks.bench_evaluate reference-draft --drafts runs/drafts --rungs raw      # one process per rung
    python -m benchmarks.bench_evaluate reference-draft --drafts runs/drafts --report         # merge, write the JSON

writes ``benchmarks/results/reference-draft.json``: ``{"al_tree_t0", "al_chain5_t0", "al_tree_t1",
"raw_data_al_tree_t0", "steps", "train_records", "ladder": {rung: {...}}}`` (the first three are the
shipped rung's, ``--shipped``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT
from benchmarks.evaluate.acceptance import SETTINGS, acceptance_lengths

# mixed: the raw records and the greedy answers together; <data>-tokens: <data>'s store trained on
# the records' own next tokens (`teacher: tokens`) rather than the target's distribution.
RUNGS = ("raw", "greedy", "t1", "mixed", "raw-tokens", "greedy-tokens")
def evaluate(draft: Path, args: argparse.Namespace, out: Path, settings: list[dict[str, Any]]) -> dict[str, Any]:
    start = time.perf_counter()
    acceptance = acceptance_lengths(
        draft, target=args.target, prompts=args.prompts, out=out, limit=args.limit,
        max_new_tokens=args.max_new_tokens, device=args.device, settings=settings,
    )
    return acceptance | {"decode_seconds": round(time.perf_counter() - start, 1)}


def training_facts(draft: Path) -> dict[str, Any]:
    """Steps and final loss from the training's metrics; samples and tokens from the store's info."""
    facts: dict[str, Any] = {}
    metrics = draft / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = [r for r in rows if "step" in r and "loss" in r]
        if steps:
            facts["steps"] = max(r["step"] for r in steps)
            facts["final_loss"] = steps[-1]["loss"]
    info = draft / "store-info.txt"
    if info.exists():
        text = info.read_text()
        for key in ("samples", "tokens"):
            found = re.search(rf"^{key}\s+([\d,]+)", text, re.MULTILINE)
            if found:
                facts[f"train_{key}"] = int(found.group(1).replace(",", ""))
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", type=Path, required=True, help="folder holding export-<rung>/")
    parser.add_argument("--rungs", default=",".join(RUNGS), help="comma-separated rungs to decode")
    parser.add_argument(
        "--settings", default=",".join(s["name"] for s in SETTINGS), help="comma-separated settings to decode"
    )
    parser.add_argument("--report", action="store_true", help="merge the rungs' results into --out")
    parser.add_argument("--shipped", default="greedy", help="the rung shipped as examples/reference-draft")
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "examples" / "reference-target")
    parser.add_argument("--prompts", type=Path, default=REPO_ROOT / "examples" / "data" / "eval_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trained-on", default="one NVIDIA H200 (lent)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "reference-draft.json")
    args = parser.parse_args(argv)

    if not args.report:
        # One file per rung and setting: the settings of a rung can decode in separate processes.
        chosen = [s for s in SETTINGS if s["name"] in args.settings.split(",")]
        tag = "+".join(s["name"] for s in chosen)
        for rung in args.rungs.split(","):
            draft = args.drafts / f"export-{rung}"
            scores = evaluate(draft, args, args.drafts / f"eval-{rung}-{tag}", chosen)
            result = {"rung": rung, **scores}
            (args.drafts / f"result-{rung}.{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
            print(json.dumps(result), flush=True)
        return 0

    ladder: dict[str, dict[str, Any]] = {}
    for rung in RUNGS:
        merged: dict[str, Any] = {"rung": rung, "decode_seconds": {}}
        for path in sorted(args.drafts.glob(f"result-{rung}.*.json")):
            result = json.loads(path.read_text())
            merged["decode_seconds"][path.name.split(".")[1]] = result.pop("decode_seconds")
            merged.update(result)
        if len(merged) > 2:
            ladder[rung] = merged | training_facts(args.drafts / f"export-{rung}")
    shipped, raw = ladder[args.shipped], ladder["raw"]
    report = {
        "al_tree_t0": shipped["al_tree_t0"],
        "al_chain5_t0": shipped["al_chain5_t0"],
        "al_tree_t1": shipped["al_tree_t1"],
        "raw_data_al_tree_t0": raw["al_tree_t0"],
        "steps": shipped.get("steps"),
        "train_records": shipped.get("train_samples"),
        "shipped_rung": args.shipped,
        "ratio_tree_t0_vs_raw": round(shipped["al_tree_t0"] / raw["al_tree_t0"], 3),
        "ladder": ladder,
        "eval": {
            "prompts": str(args.prompts.relative_to(REPO_ROOT)) if args.prompts.is_relative_to(REPO_ROOT) else str(args.prompts),
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
            "settings": SETTINGS,
            "dtype": "float32",
        },
        "trained_on": args.trained_on,
        "decoded_on": {"python": platform.python_version(), "machine": platform.machine()},
        "date": time.strftime("%Y-%m-%d"),
    }
    # Keys other benchmarks add to the file (bench_evaluate ceiling's acceptance_ceiling) stay.
    if args.out.exists():
        report = {k: v for k, v in json.loads(args.out.read_text()).items() if k not in report} | report
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0

