"""``hsstore import`` of SpecForge dumps: throughput against the disk's read speed, and bytes
(issue 30's aim: >= the disk's read speed / 2, and <= 1/3 of the bytes with the compact preset).

The SpecForge files hold real features: the reference target's, extracted once by the project's
extraction (``--records`` records, truncated to ``--max-length`` tokens) and written by ``hsstore
export-features --format specforge``; the ``--files`` files of the dump repeat those samples in
turn (file i holds sample i mod n, under its own name). Then, with the same page-cache state for
the import (``--cold`` drops the page cache first, which needs root and affects the whole
machine):

1. the disk's read speed: every file read once with O_DIRECT (the page cache bypassed), with
   ``--read-threads`` threads; and the same through the page cache, for reference;
2. ``hsstore import --preset compact`` of the dump (fp8 aux, top-20 logits from the final state,
   zstd), timed end to end (listing, reading, torch.load, checks, lm_head top-k, encoding, writing,
   commits), with its CPU time (the process's and its workers', every thread) and the machine's
   load average before and after: on a shared machine the seconds depend on the other jobs, the
   CPU seconds much less.

Writes ``--out`` (default ``benchmarks/results/import.json``)::

    {"files": n, "source_bytes": x, "store_bytes": x, "seconds": x, ...read speed, ratios}

CPU, small: ``python -m benchmarks.bench_store import --files 2000 --workdir /tmp/bench-import``;
the issue's size: ``--files 10000`` (about 4 GB of files at --max-length 512).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, write_results


def build_dump(args: argparse.Namespace) -> Path:
    """The SpecForge dump of ``args.files`` files (built once per workdir)."""
    from pipelines.export.features import export_features
    from pipelines.export.peer_layouts import specforge_sample_path
    from tests.support.paths import TRAIN_DATA
    from tests.support.stores import extract_reference_store

    dump = args.workdir / "specforge"
    if (dump / "done").exists():
        return dump
    store = args.workdir / "extracted"
    if not store.exists():
        extract_reference_store(
            str(store), Path(TRAIN_DATA), num_records=args.records, max_length=args.max_length,
            token_budget=max(4 * args.max_length, 2048),
        )
    samples = args.workdir / "samples"
    shutil.rmtree(samples, ignore_errors=True)
    summary = export_features(str(store), samples, "specforge", progress=False)
    num = summary.num_samples
    for i in range(args.files):
        target = dump / specforge_sample_path(i)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(samples / specforge_sample_path(i % num), target)
    (dump / "done").write_text(f"{args.files} files from {num} samples\n")
    return dump


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_all(dump: Path, threads: int, direct: bool) -> tuple[int, float]:
    """Every file read once by ``threads`` threads; ``direct``: with O_DIRECT, so the bytes come
    from the disk whatever the page cache holds (and the cache is left alone)."""
    import mmap

    paths = sorted(dump.rglob("*.ckpt"))
    start = time.perf_counter()

    def read(path: Path) -> int:
        if not direct:
            with open(path, "rb") as handle:
                return len(handle.read())
        buffer = mmap.mmap(-1, 4 << 20)  # page-aligned, as O_DIRECT needs
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            total = 0
            while count := os.readv(fd, [buffer]):
                total += count
            return total
        finally:
            os.close(fd)
            buffer.close()

    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, paths))
    return total, time.perf_counter() - start


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (``--workers``)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--records", type=int, default=60, help="records extracted (samples repeated over the files)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--read-threads", type=int, default=4, help="threads of the disk's read-speed measure")
    parser.add_argument("--threads", type=int, default=None, help="the import's threads (default: the cores)")
    parser.add_argument("--samples-per-shard", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=1, help="import processes (each with its share of --threads)")
    parser.add_argument("--device", default="cpu", help="where the top-k projection runs")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each pass (root)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hsstore-bench-import"))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "import.json")
    args = parser.parse_args(argv)

    import torch

    from pipelines.peer_import import import_features
    from tests.support.paths import REFERENCE_TARGET

    args.workdir.mkdir(parents=True, exist_ok=True)
    dump = build_dump(args)
    cold = args.cold and drop_caches()
    read_bytes, read_seconds = read_all(dump, args.read_threads, direct=True)
    warm_bytes, warm_seconds = read_all(dump, args.read_threads, direct=False)
    store_url = args.workdir / "store"
    shutil.rmtree(store_url, ignore_errors=True)
    if args.cold:
        drop_caches()
    load_before, cpu_before = os.getloadavg()[0], _cpu_seconds()
    summary = import_features(
        dump, str(store_url), format="specforge", target=str(REFERENCE_TARGET), aux_layer_ids=[2, 4, 5],
        codec="fp8_e4m3", compression="zstd", teacher="topk", topk_k=20, device=args.device,
        samples_per_shard=args.samples_per_shard, threads=args.threads,
        workers=args.workers, progress=False,
    )
    cpu_seconds, load_after = _cpu_seconds() - cpu_before, os.getloadavg()[0]
    store_bytes = sum(p.stat().st_size for p in store_url.rglob("*") if p.is_file())
    results: dict[str, Any] = {
        "files": summary.num_files,
        "source_bytes": summary.source_bytes,
        "store_bytes": store_bytes,
        "seconds": summary.seconds,
        "tokens": summary.num_tokens,
        "store_over_source": store_bytes / summary.source_bytes,
        "import_mb_per_s": summary.source_bytes / summary.seconds / 1e6,
        "disk_read_mb_per_s": read_bytes / read_seconds / 1e6,
        "import_over_disk_read_speed": (summary.source_bytes / summary.seconds) / (read_bytes / read_seconds),
        "disk_read_seconds": read_seconds,
        "import_cpu_seconds": cpu_seconds,
        "load_average_1min_before_after": [load_before, load_after],
        "disk_read": "O_DIRECT reads of every file, --read-threads threads (the page cache bypassed)",
        "page_cache_read_mb_per_s": warm_bytes / warm_seconds / 1e6,
        "import_page_cache": "dropped before the import" if cold else "as left by the reads (warm)",
        "workers": args.workers,
        "threads": summary.threads,
        "preset": "compact: fp8_e4m3 aux, top-20 bf16 logits + int32 ids, zstd",
        "target": "examples/reference-target (H=384, vocab 8192)",
        "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "read_threads": args.read_threads, "device": args.device,
        },
        "argv": sys.argv[1:] if argv is None else argv,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, results)
    print(json.dumps(results, indent=2))
    return 0

