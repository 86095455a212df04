"""Where a target's load goes (issue 31's start): imports, the CUDA context, reading the files
(cold and from the page cache), hashing them, the checkpoint reader, from_pretrained.

    python -m benchmarks.investigations.profile_model_load MODEL_DIR --out OUT.json

Each figure is one timed step in this order; "cold" steps first drop the page cache when the
machine lets us (``/proc/sys/vm/drop_caches``; ``dropped_caches`` says whether it did).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def meminfo() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        if name in ("MemTotal", "MemAvailable", "Cached", "Dirty"):
            fields[name + "_gb"] = round(int(value.split()[0]) / 1e6, 1)
    return fields


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_all(files: list[Path], threads: int) -> float:
    """Every byte read once, 64 MiB at a time, ``threads`` at once; seconds."""
    pieces = [(path, offset) for path in files for offset in range(0, path.stat().st_size, 64 << 20)]

    import threading

    local = threading.local()

    def read(piece: tuple[Path, int]) -> None:
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(64 << 20)
        with open(piece[0], "rb", buffering=0) as handle:
            handle.seek(piece[1])
            handle.readinto(local.buffer)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, pieces))
    return time.perf_counter() - start


def sha256_all(files: list[Path]) -> float:
    start = time.perf_counter()

    def digest(path: Path) -> None:
        hasher = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(16 << 20):
                hasher.update(block)

    with ThreadPoolExecutor(len(files)) as pool:
        list(pool.map(digest, files))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    model_dir = Path(args.model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    size = sum(path.stat().st_size for path in files)
    result: dict[str, Any] = {"files": len(files), "gb": size / 1e9, "meminfo_start": meminfo()}
    cgroup = Path("/sys/fs/cgroup/memory.max")
    result["cgroup_memory_max"] = cgroup.read_text().strip() if cgroup.exists() else None

    def timed(name: str, fn: Any) -> Any:
        start = time.perf_counter()
        value = fn()
        result[name] = round(time.perf_counter() - start, 3)
        print(f"{name}: {result[name]} s", flush=True)
        return value

    timed("import_torch_s", lambda: __import__("torch"))
    import torch

    device = torch.device(args.device)
    timed("cuda_init_s", lambda: torch.empty(1, device=device))
    timed("import_transformers_model_s", lambda: __import__("transformers").AutoModelForCausalLM)
    result["dropped_caches"] = drop_caches()
    result["read_cold_8_threads_s"] = round(read_all(files, 8), 3)
    result["read_warm_8_threads_s"] = round(read_all(files, 8), 3)
    result["read_warm_1_thread_s"] = round(read_all(files, 1), 3)
    result["meminfo_after_reads"] = meminfo()
    result["sha256_warm_s"] = round(sha256_all(files), 3)

    from pipelines.extract.checkpoint_reader import read_checkpoint
    from pipelines.extract.target import load_target

    def release() -> None:
        import gc

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    tensors = timed("reader_warm_s", lambda: read_checkpoint(files, device))
    del tensors
    release()
    timed("reader_warm_again_s", lambda: read_checkpoint(files, device))
    release()
    model = timed("load_target_reader_warm_s", lambda: load_target(str(model_dir), device=device))
    del model
    release()
    model = timed("load_target_from_pretrained_warm_s",
                  lambda: load_target(str(model_dir), device=device, weights_loader="transformers"))
    del model
    release()
    result["dropped_caches_again"] = drop_caches()
    model = timed("load_target_reader_cold_s", lambda: load_target(str(model_dir), device=device))
    del model
    release()
    drop_caches()
    model = timed("load_target_from_pretrained_cold_s",
                  lambda: load_target(str(model_dir), device=device, weights_loader="transformers"))
    del model
    result["meminfo_end"] = meminfo()
    result["gb_per_s"] = {key: round(size / 1e9 / value, 2) for key, value in result.items()
                          if key.endswith("_s") and key.startswith(("read_", "sha256", "reader", "load_target")) and value}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
