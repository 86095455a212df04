"""Issue 13.5: memory and speed of `hsstore extract RECIPE --dry-run` over many short records.

Writes ``--records`` short records (two thirds plain text, one third chats, a few bad lines and
duplicates), runs the dry run of the reference recipe over them as a child process, and samples the
memory of that process and its children (the tokenizing pool and its fork server) every 50 ms from
/proc: the sum of RSS (counts pages shared between processes once per process) and of PSS (shared
pages split between the processes that share them: what the tree really holds). Peaks are reported.

    python -m benchmarks.bench_extract dry-run-memory --records 300000 --out benchmarks/results/extract-dry-run.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, write_results


def write_records(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["def", "return", "x", "value", "list", "for", "in", "range", "print", "the", "a", "data", "if", "else"]
    with open(path, "w") as handle:
        for n in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) + f" {n}"
            if n % 3 == 2:
                record: Any = {"id": f"c{n}", "messages": [
                    {"role": "user", "content": f"question {n}: " + text[:40]},
                    {"role": "assistant", "content": text},
                ]}
            else:
                record = {"id": f"t{n}", "text": text}
            handle.write(json.dumps(record) + "\n")
            if n % 10007 == 3:
                handle.write("{not json\n")


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        current = stack.pop()
        out.append(current)
        stack.extend(children.get(current, []))
    return out


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB, 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return int(fields["Rss"].split()[0]), int(fields["Pss"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--workers", type=int, default=None, help="planning.num_workers (default: every core)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "short.jsonl"
        write_records(data, args.records)
        command = [
            sys.executable, "-m", "pipelines.cli", "extract", "recipes/reference/extract.yaml", "--dry-run", "--json",
            "--set", f"data=[{data}]", "--set", f"store={Path(tmp) / 'never-written'}",
        ]
        if args.workers:
            command += ["--set", f"planning.num_workers={args.workers}"]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        start = time.perf_counter()
        child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak_rss = peak_pss = peak_driver = peak_processes = 0
        while child.poll() is None:
            pids = tree(child.pid)
            sizes = [memory_kb(p) for p in pids]
            peak_rss = max(peak_rss, sum(s[0] for s in sizes))
            peak_pss = max(peak_pss, sum(s[1] for s in sizes))
            peak_driver = max(peak_driver, sizes[0][0])
            peak_processes = max(peak_processes, sum(1 for s in sizes if s[0]))
            time.sleep(0.05)
        stdout, stderr = child.communicate()
        seconds = time.perf_counter() - start
        if child.returncode != 0:
            sys.stderr.write(stderr[-3000:])
            return 1
        summary = json.loads(stdout[stdout.index("{"):])
        assert not (Path(tmp) / "never-written").exists(), "a dry run wrote to the store"
    result = {
        "records": args.records,
        "num_records": summary["num_records"],
        "num_samples": summary["num_samples"],
        "num_tokens": summary["num_tokens"],
        "rejected": summary["rejected"],
        "num_units": summary["num_units"],
        "seconds": seconds,
        "records_per_s": summary["num_records"] / seconds,
        "peak_tree_pss_mb": peak_pss / 1024,
        "peak_tree_rss_mb": peak_rss / 1024,
        "peak_driver_rss_mb": peak_driver / 1024,
        "peak_processes": peak_processes,
        "planning_workers": args.workers or len(os.sched_getaffinity(0)),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "-m", "benchmarks.bench_extract", "dry-run-memory", *(argv or sys.argv[1:])]),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        write_results(args.out, result)
    return 0

