"""ShardWriter throughput: how fast one shard of bf16 features reaches the disk.

Extraction on a GPU produces ~1 GB/s of bf16 features for an 8B target (docs/design.md). ``ShardWriter``
streams each array's inner chunks to its file from a thread of its own (crc32c and sha256 computed
as it writes). This measures GB/s against a plain ``numpy.tofile`` of the same bytes, the disk's
ceiling for this process, for one Zarr shard file per array (``--shard-chunks 0``, the default) and
for a file every N chunks.

    python -m benchmarks.bench_store shard-write --hidden 4096 --tokens 65536 --shard-chunks 0 64
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import machine_info, write_results
from hsstore import FeatureSpec, ShardWriter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per shard")
    parser.add_argument("--sample-tokens", type=int, default=1024)
    parser.add_argument("--shard-chunks", type=int, nargs="+", default=[0, 64], help="0: one file per array")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    H, T = args.hidden, args.sample_tokens
    aux = rng.integers(0, 1 << 16, (T, 3, H), dtype=np.uint16)
    final = rng.integers(0, 1 << 16, (T, H), dtype=np.uint16)
    # bf16 torch tensors, as extraction hands them over (the codec is then a view, so this measures
    # the writer, not a float32 -> bf16 rounding); non-finite bit patterns zeroed.
    import torch

    aux[(aux & 0x7F80) == 0x7F80] = 0
    final[(final & 0x7F80) == 0x7F80] = 0
    aux_f = torch.from_numpy(aux.view(np.int16)).view(torch.bfloat16)
    final_f = torch.from_numpy(final.view(np.int16)).view(torch.bfloat16)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-shard-write-"))
    num_samples = args.tokens // T
    rows = []

    raw_bytes = num_samples * (aux.nbytes + final.nbytes)
    times = []
    for _ in range(args.repeats):
        target = root / "raw.bin"
        started = time.perf_counter()
        with open(target, "wb") as handle:
            for _ in range(num_samples):
                aux.tofile(handle)
                final.tofile(handle)
        times.append(time.perf_counter() - started)
        target.unlink()
    rows.append({"writer": "numpy.tofile (ceiling)", "shard_chunks": "-", "files": 1, "gb_per_s": raw_bytes / statistics.median(times) / 1e9})

    for shard_chunks in args.shard_chunks:
        specs = [
            FeatureSpec(name="aux_hidden_states", shape=(3, H), shard_chunks=shard_chunks or None),
            FeatureSpec(name="final_hidden_state", shape=(H,), shard_chunks=shard_chunks or None),
        ]
        times = []
        for repeat in range(args.repeats):
            url = str(root / f"store-{shard_chunks}-{repeat}")
            started = time.perf_counter()
            writer = ShardWriter(url, "u000000", specs)
            for i in range(num_samples):
                writer.add_sample(sample_id=f"s{i}", source_id="x", input_ids=np.zeros(T, np.int32),
                                  loss_mask=np.ones(T, np.uint8),
                                  features={"aux_hidden_states": aux_f, "final_hidden_state": final_f})
            record = writer.finish()
            times.append(time.perf_counter() - started)
            shutil.rmtree(url)
        rows.append({"writer": "ShardWriter (bf16, crc32c, sha256)", "shard_chunks": shard_chunks or "one file", "files": len(record.files),
                     "gb_per_s": record.num_bytes / statistics.median(times) / 1e9,
                     "tokens_per_s": args.tokens / statistics.median(times)})
    shutil.rmtree(root, ignore_errors=True)
    print("| writer | shard_chunks | files | GB/s | tokens/s |\n|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['writer']} | {row['shard_chunks']} | {row['files']} | {row['gb_per_s']:.2f} | {row.get('tokens_per_s', 0):,.0f} |")
    if args.out:
        write_results(args.out, {"hidden": H, "tokens": args.tokens, "machine": machine_info(), "rows": rows})

