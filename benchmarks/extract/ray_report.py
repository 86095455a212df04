"""Turn ``bench_extract ray``'s output folder into a dated benchmarks/LOG.md section and the results files.

    python -m benchmarks.bench_extract ray-report OUT_DIR            # print the section
    python -m benchmarks.bench_extract ray-report OUT_DIR --write    # and append it to LOG.md, write
                                                                     # results/extract-h200.json and
                                                                     # results/object-store.json's split_target

RESULTS.md's extraction table is then updated by hand (it holds the current numbers only).

Only numbers found in OUT_DIR's JSON are written; a run that is missing is shown as "not run".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT

BENCH = REPO_ROOT / "benchmarks"


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "not run" if value is None else format(value, spec)


def section(extract: dict[str, Any], split: dict[str, Any] | None) -> str:
    bare = extract["bare_tokens_per_s"]
    runs = extract["runs"]
    machine = extract["machine"]
    settings = extract["settings"]
    lines = [
        f"## {extract['date']}: extraction through Ray at the GPU's limit (issue 13)",
        "",
        f"`{extract['command']}` (stage `extract-ray` of `tools/gpu_session.sh`) on "
        f"{', '.join(machine.get('gpus', []))}; {machine.get('cpus')} CPUs, Python {machine.get('python')}, "
        f"torch {machine.get('torch')}, transformers {machine.get('transformers')}, Ray {machine.get('ray', '?')}. "
        f"The {settings['shape']} shape with random bf16 weights, {extract['num_tokens']:,} tokens of "
        f"{settings['min_length']:,}-{settings['max_length']:,}-token text records, 3 aux layers + final, "
        f"max_length {settings['max_length_cap']:,}, token budget {settings['token_budget']:,}, units of "
        f"{settings['unit_tokens']:,} tokens, recipe defaults otherwise (no attention mask for Qwen3, "
        f"length-sorted windows). Tokens/s: real tokens over the run's extraction time (actors started "
        f"and models loaded).",
        "",
        "| run | tokens/s | per GPU vs bare | writer busy | written GB/s | store B/token |",
        "|---|---:|---:|---:|---:|---:|",
        f"| bare `model.model(input_ids)`, no mask, the same batches, 1 GPU | {bare:,.0f} | 1.000 | | | |",
    ]
    labels = {"bf16-1": "extract, bf16, Ray, 1 actor (1 GPU)", "bf16-2": "extract, bf16, Ray, 2 actors (2 GPUs)",
              "fp8-1": "extract, fp8_e4m3 aux + final, Ray, 1 actor", "fp8-2": "extract, fp8_e4m3, Ray, 2 actors"}
    for name, label in labels.items():
        r = runs.get(name)
        if r is None:
            lines.append(f"| {label} | not run | | | | |")
            continue
        gpus = int(name[-1])
        lines.append(
            f"| {label} | {r['tokens_per_second']:,.0f} | {r['tokens_per_second'] / gpus / bare:.3f} | "
            f"{100 * r['writer_busy_fraction']:.0f}% | {r['write_gb_per_s']:.2f} | {r['bytes_per_token']:,.0f} |"
        )
    ray = extract["ray"]
    scaling = {codec: (v["gpus_2"] / v["gpus_1"] if v["gpus_1"] and v["gpus_2"] else None) for codec, v in ray.items()}
    lines += [
        "",
        f"Padding: {100 * extract['padding_fraction']:.2f}% of computed tokens. Disk: "
        f"{extract['disk_gb_per_s']:.2f} GB/s ({settings['disk_gib']} GiB written and fsynced). 2 GPUs / 1 GPU: bf16 "
        f"{fmt(scaling.get('bf16'), '.2f')}, fp8 {fmt(scaling.get('fp8_e4m3'), '.2f')} (x).",
    ]
    if split is not None:
        s = split["split_target"]
        lines += [
            "",
            f"Split target (issue 16.3): one actor owning {s['gpus']} GPUs (`ray.num_gpus_per_worker: {s['gpus']}`), "
            f"layers in two blocks, {s['num_tokens']:,} tokens: {s['tokens_per_s']:,.0f} tokens/s vs "
            f"{s['one_gpu_tokens_per_s']:,.0f} on one GPU; largest per-token relative error of its features vs one "
            f"GPU's on the same batches {fmt(s['max_rel_err_vs_one_gpu'], '.2e')} ({s['samples_compared']} samples), "
            f"vs the 1-GPU store (batched differently) {fmt(s.get('max_rel_err_vs_one_gpu_store'), '.2e')}.",
        ]
    lines += ["", "Numbers: `benchmarks/results/extract-h200.json`, `benchmarks/results/object-store.json` (`split_target`)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    extract = json.loads((out / "extract-h200.json").read_text())
    split_path = out / "split-target.json"
    split = json.loads(split_path.read_text()) if split_path.exists() else None
    text = section(extract, split)
    print(text)
    if args.write:
        (BENCH / "results").mkdir(exist_ok=True)
        (BENCH / "results" / "extract-h200.json").write_text(json.dumps(extract, indent=2) + "\n")
        if split is not None:
            store_path = BENCH / "results" / "object-store.json"
            store = json.loads(store_path.read_text()) if store_path.exists() else {}
            store["split_target"] = split["split_target"]
            store_path.write_text(json.dumps(store, indent=2) + "\n")
        log = BENCH / "LOG.md"  # newest last
        log.write_text(log.read_text().rstrip("\n") + "\n\n" + text + "\n")
    return 0

