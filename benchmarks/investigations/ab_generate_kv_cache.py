"""A/B of ``hsstore generate``'s KV cache: the preallocated layers (``pipelines/generate/kv_cache.py``)
against transformers' ``DynamicCache`` (a ``torch.cat`` of each layer's whole cache per step), the
same decode loop, the same requests, passes alternating.

    python -m benchmarks.investigations.ab_generate_kv_cache --batch 256 --new-tokens 128 --threads 2 \\
        --out benchmarks/results/generate-kv-cache-cpu.json

The target is the reference target (real weights); prompts are random token ids of 150-250
tokens, greedy, no stop token (every answer runs to ``--new-tokens``). Reported: each path's
seconds per pass, tokens/s of the median pass, the speedup, and whether both decoded the same
tokens. Several settings append to one ``--out`` file (``runs``). ``--profile FILE`` then decodes
one more pass (preallocated) under ``torch.profiler`` and writes its operators by host time and by
device time (where a host-bound loop spends its step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO_ROOT


def profile_pass(generator: Any, requests: list[Any], out: Path) -> None:
    """One preallocated pass under torch.profiler: the operators by self host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        generator.generate_ids(requests)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table = prof.key_averages()
    header = f"one pass under the profiler: {time.perf_counter() - started:.2f} s\n"
    by_device = table.table(sort_by="self_cuda_time_total", row_limit=25) if torch.cuda.is_available() else ""
    out.write_text(header + table.table(sort_by="self_cpu_time_total", row_limit=40) + "\n" + by_device + "\n")


def run(
    batch: int, new_tokens: int, threads: int, repeats: int, device: str, dtype: str, profile: Path | None = None
) -> dict[str, Any]:
    from pipelines.extract.target import load_target
    from pipelines.generate import engine
    from pipelines.generate.engine import BatchGenerator, SamplingParams
    from pipelines.generate.prompts import Request

    torch.set_num_threads(threads)
    model = load_target(str(REPO_ROOT / "examples" / "reference-target"), dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    requests = []
    for i in range(batch):
        length = int(torch.randint(150, 250, (1,), generator=gen))
        requests.append(Request(tuple(torch.randint(10, 8000, (length,), generator=gen).tolist()), new_tokens, i))
    generator = BatchGenerator(model, None, stop_token_ids=[], pad_token_id=0, params=SamplingParams(),
                               max_batch_size=batch, token_budget=10**9)
    paths = ("preallocated", "dynamic")  # engine.KV_CACHE
    chosen = engine.KV_CACHE
    generator.generate_ids(requests[:4])  # imports and first-call costs outside the clock
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, Any] = {}
    try:
        for rep in range(repeats):
            for name in (["preallocated", "dynamic"] if rep % 2 == 0 else ["dynamic", "preallocated"]):
                engine.KV_CACHE = name
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                started = time.perf_counter()
                tokens[name] = generator.generate_ids(requests)
                seconds[name].append(round(time.perf_counter() - started, 2))
        if profile is not None:
            engine.KV_CACHE = "preallocated"
            profile_pass(generator, requests, profile)
    finally:
        engine.KV_CACHE = chosen
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "batch": batch, "new_tokens": new_tokens, "threads": threads, "device": device, "dtype": dtype,
        "seconds": seconds, "tokens_per_s": {name: round(batch * new_tokens / s) for name, s in median.items()},
        "speedup": round(median["dynamic"] / median["preallocated"], 3),
        "same_tokens": tokens["preallocated"] == tokens["dynamic"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None, help="append this run to the file's 'runs'")
    parser.add_argument("--profile", type=Path, default=None, help="write one profiled pass's operator tables here")
    args = parser.parse_args(argv)
    row = run(args.batch, args.new_tokens, args.threads, args.repeats, args.device, args.dtype, args.profile)
    row["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    row["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    print(json.dumps(row))
    if args.out is not None:
        results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
        results["runs"].append(row)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
