"""Store vs per-sample files: write and read throughput on CPU (issue 2, "Benchmark").

One run writes the same synthetic hidden states (T tokens x (3 aux layers + final), bf16) in every
layout and reads each back as a shuffled epoch of bf16 torch tensors, cold and warm:

- ``per-sample bf16``: what today's trainers use (SpecForge / ModelOpt offline mode): one
  ``torch.save`` dict per sample in folders of 2000 files, read in a fully shuffled order by a thread
  pool with ``torch.load(mmap=True, weights_only=True)``; the thread materialises the tensors (the
  page faults are the read) and the consumer packs samples into rows of ``--token-budget`` tokens.
- ``store <codec>``: this store (bf16, bf16+zstd, fp8_e4m3, fp8_e4m3+zstd, fp8_e4m3+blosc), read with
  the library's own :class:`hsstore.loader.StreamingLoader` (shard order + windowed shuffle, long
  ``Store.read_token_range`` reads straight into the batch buffers, several in flight, rows packed
  to the same budget), decoded to bf16 tensors on the CPU (``decode_on_host=True``: fp8 is decoded
  by the loader's assembler thread with :func:`hsstore.format.codecs.decode_torch`, then
  :func:`hsstore.torch_data.to_device` views the bf16 bits). Each store epoch is also timed "bits only"
  (no decode): what the host hands a GPU, which decodes there (the production path).

Runs of different layouts are interleaved (repeat 1 of every layout, then repeat 2, ...) so that
load from other processes on a shared machine hits every layout alike; medians are reported.
Cold means the page cache was dropped (``/proc/sys/vm/drop_caches``; without root, ``posix_fadvise
DONTNEED`` on every file) right before the run; ``fincore`` confirms what stayed resident.

Usage: ``python -m benchmarks.bench_store [--quick] [--out results.json]``; see ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hsstore
from benchmarks.common import machine_info, run_modes, write_results
from hsstore.format.layout import SCALE_GROUPING
from hsstore.loader import StreamingLoader
from hsstore.torch_data import to_device

NUM_AUX = 3
FILES_PER_FOLDER = 2000  # SpecForge/ModelOpt-style dumps: rows/<folder>/data_<i>.ckpt
FEATURES = ("aux_hidden_states", "final_hidden_state")
STORE_CODECS: dict[str, tuple[str, str]] = {
    "store bf16": ("bf16", "none"),
    "store bf16+zstd": ("bf16", "zstd"),
    "store fp8_e4m3": ("fp8_e4m3", "none"),
    "store fp8_e4m3+zstd": ("fp8_e4m3", "zstd"),
    "store fp8_e4m3+blosc": ("fp8_e4m3", "blosc"),
}
BASELINE = "per-sample bf16"
# bf16 GiB of features written per layout (full run): sized so the whole run takes < 10 min here.
DEFAULT_GIB = {4096: 1.5, 384: 0.5}


@dataclass(frozen=True)
class Settings:
    hidden_sizes: list[int]
    gib: dict[int, float]
    repeats: int
    write_repeats: int
    layouts: list[str]
    token_budget: int
    max_len: int
    mean_len: int
    read_threads: int
    prefetch_batches: int
    baseline_threads: int
    shuffle_window: int
    chunk_tokens: dict[int, int]  # per hidden size; missing: FeatureSpec's default
    shard_chunks: int | None  # None: one Zarr shard file per array per store shard
    compression_level: int
    shard_max_tokens: int
    cold: str  # "drop", "fadvise" or "skip"
    disk_mbps: int  # > 0: also cold epochs with the disk's reads throttled to this (blkio cgroup)
    bits_only: bool
    workdir: Path | None  # None: a fresh folder made by main()
    seed: int


# -- synthetic features ---------------------------------------------------------------------------


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux: torch.Tensor  # bf16 [T, 3, H]
    final: torch.Tensor  # bf16 [T, H]


def sample_lengths(total_tokens: int, mean_len: int, max_len: int, seed: int) -> list[int]:
    """Chat-like lengths: log-normal around ``mean_len``, clipped to [32, max_len], summing to ~total."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total_tokens:
        length = int(np.clip(rng.lognormal(np.log(mean_len) - 0.18, 0.6), 32, max_len))
        lengths.append(min(length, total_tokens - sum(lengths)) if sum(lengths) + length > total_tokens else length)
    return [n for n in lengths if n > 0]


class HiddenStateModel:
    """Hidden states that look like a real LLM's, so compression ratios are honest.

    Per channel: a log-normal spread of scales and a small mean; per token: a log-normal norm; per
    layer: growing magnitude (residual stream); a few fixed "massive activation" channels 20-150x
    the typical scale; the first token of every sample (the attention sink) 30x larger. The final
    state is post-norm: unit scale times a norm weight, outliers damped.
    """

    def __init__(self, hidden: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        num_layers = NUM_AUX + 1
        self.hidden = hidden
        self.gen = gen
        self.channel_std = torch.exp(0.4 * torch.randn(num_layers, hidden, generator=gen))
        self.channel_mean = 0.2 * torch.randn(num_layers, hidden, generator=gen) * self.channel_std
        self.layer_scale = torch.tensor([1.0, 4.0, 16.0, 1.0])
        num_outliers = max(1, hidden // 1000)
        self.outliers = torch.randperm(hidden, generator=gen)[:num_outliers]
        self.outlier_gain = torch.tensor([20.0, 60.0, 150.0, 8.0])
        self.outlier_sign = torch.where(torch.rand(num_outliers, generator=gen) < 0.5, -1.0, 1.0)
        self.std = self.channel_std * self.layer_scale[:, None]
        self.mean = self.channel_mean * self.layer_scale[:, None]
        self.bump = self.outlier_gain[:, None] * self.layer_scale[:, None] * self.outlier_sign

    def sample(self, num_tokens: int) -> torch.Tensor:
        """float32 [T, 4, H]: 3 aux layers then the final state."""
        gen = self.gen
        values = torch.randn(num_tokens, NUM_AUX + 1, self.hidden, generator=gen)
        values.mul_(self.std).add_(self.mean)  # one pass each: data generation is not what we time
        token_norm = torch.exp(0.3 * torch.randn(num_tokens, 1, 1, generator=gen)).repeat(1, NUM_AUX + 1, 1)
        token_norm[0, :NUM_AUX] *= 30.0  # attention sink (the residual stream only)
        token_norm[:, NUM_AUX] = token_norm[:, NUM_AUX].clamp(max=3.0)  # post-norm: bounded
        values.mul_(token_norm)
        values[:, :, self.outliers] += self.bump * (1 + 0.1 * torch.randn(num_tokens, 1, 1, generator=gen))
        return values


def make_samples(hidden: int, total_tokens: int, settings: Settings) -> list[Sample]:
    model = HiddenStateModel(hidden, settings.seed)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    samples = []
    for length in sample_lengths(total_tokens, settings.mean_len, settings.max_len, settings.seed):
        values = model.sample(length).to(torch.bfloat16)
        mask = torch.ones(length, dtype=torch.uint8)
        mask[: max(1, length // 4)] = 0  # the prompt part
        samples.append(
            Sample(
                input_ids=torch.randint(0, 150_000, (length,), generator=gen),
                loss_mask=mask,
                aux=values[:, :NUM_AUX].contiguous(),
                final=values[:, NUM_AUX].contiguous(),
            )
        )
    return samples


# -- writing --------------------------------------------------------------------------------------


def write_per_sample(root: Path, samples: list[Sample]) -> None:
    for i, sample in enumerate(samples):
        folder = root / f"{i // FILES_PER_FOLDER:05d}"
        if i % FILES_PER_FOLDER == 0:
            folder.mkdir(parents=True, exist_ok=True)
        record = {
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
            "aux_hidden_states": sample.aux,
            "final_hidden_state": sample.final,
        }
        torch.save(record, folder / f"data_{i}.ckpt")


def store_specs(layout: str, hidden: int, settings: Settings) -> list[hsstore.FeatureSpec]:
    """Both features get ``--chunk-tokens`` tokens per inner chunk if given, else FeatureSpec's
    default (a power of two of at most 2 MiB and 1,024 tokens per array, so the final state's chunks
    hold more tokens than the aux states')."""
    codec, compression = STORE_CODECS[layout]
    common: dict[str, Any] = {
        "codec": codec,
        "compression": compression,
        "compression_level": settings.compression_level,
        "shard_chunks": settings.shard_chunks,
        "chunk_tokens": settings.chunk_tokens.get(hidden) or None,
    }
    return [
        hsstore.FeatureSpec(name=FEATURES[0], shape=(NUM_AUX, hidden), **common),
        hsstore.FeatureSpec(name=FEATURES[1], shape=(hidden,), **common),
    ]


def write_store(root: Path, layout: str, samples: list[Sample], settings: Settings) -> None:
    hidden = samples[0].final.shape[-1]
    lineage = hsstore.Lineage(aux_layer_ids=[2, 18, 33], max_length=settings.max_len, code_version="bench_store")
    with hsstore.StoreWriter(str(root), store_specs(layout, hidden, settings), lineage, shard_max_tokens=settings.shard_max_tokens) as writer:
        for i, sample in enumerate(samples):
            writer.add_sample(
                sample_id=f"bench-{i:07d}",
                source_id=f"record-{i}",
                input_ids=sample.input_ids,
                loss_mask=sample.loss_mask,
                features={FEATURES[0]: sample.aux, FEATURES[1]: sample.final},
            )


def timed_write(root: Path, layout: str, samples: list[Sample], settings: Settings) -> dict[str, float]:
    """Seconds to write (buffered) and to have the data on disk (after ``sync``)."""
    if root.exists():
        shutil.rmtree(root)
    os.sync()
    started = time.perf_counter()
    if layout == BASELINE:
        write_per_sample(root, samples)
    else:
        write_store(root, layout, samples, settings)
    buffered = time.perf_counter() - started
    os.sync()
    return {"buffered_s": buffered, "synced_s": time.perf_counter() - started}


# -- reading --------------------------------------------------------------------------------------


def list_files(root: Path) -> list[Path]:
    return sorted(Path(dirpath) / name for dirpath, _, names in os.walk(root) for name in names)


def load_sample(path: Path) -> dict[str, torch.Tensor]:
    """What a trainer's Dataset.__getitem__ does, with the mmap'd pages touched (copied) here, in the
    pool thread, as a DataLoader worker's collate would: otherwise the consumer would do the I/O."""
    record = torch.load(path, mmap=True, weights_only=True)
    return {key: value.clone() for key, value in record.items()}


class RowPacker:
    """Packs samples greedily into ``[budget]`` rows (the baseline's collate): one bf16 copy each."""

    def __init__(self, budget: int, hidden: int):
        self.budget, self.hidden = budget, hidden
        self._new()

    def _new(self) -> None:
        self.ids = torch.zeros(self.budget, dtype=torch.int64)
        self.mask = torch.zeros(self.budget, dtype=torch.uint8)
        self.aux = torch.zeros(self.budget, NUM_AUX, self.hidden, dtype=torch.bfloat16)
        self.final = torch.zeros(self.budget, self.hidden, dtype=torch.bfloat16)
        self.cursor = 0

    def add(self, sample: dict[str, torch.Tensor]) -> int:
        """Returns 1 when a row was completed (and a new one started)."""
        n = min(len(sample["input_ids"]), self.budget)
        emitted = 0
        if self.cursor + n > self.budget:
            self._new()
            emitted = 1
        end = self.cursor + n
        self.ids[self.cursor : end] = sample["input_ids"][:n]
        self.mask[self.cursor : end] = sample["loss_mask"][:n]
        self.aux[self.cursor : end] = sample["aux_hidden_states"][:n]
        self.final[self.cursor : end] = sample["final_hidden_state"][:n]
        self.cursor = end
        return emitted


def bounded_map(pool: ThreadPoolExecutor, fn: Any, items: list[Any], depth: int) -> Iterator[Any]:
    """``pool.map`` with at most ``depth`` results in flight (the stdlib submits everything at once)."""
    pending: deque[Future[Any]] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def read_per_sample(root: Path, hidden: int, seed: int, settings: Settings) -> dict[str, float]:
    started = time.perf_counter()
    files = list_files(root)  # trainers list the dump folder at start-up
    order = np.random.default_rng(seed).permutation(len(files))
    setup = time.perf_counter() - started
    packer = RowPacker(settings.token_budget, hidden)
    tokens = rows = 0
    with ThreadPoolExecutor(settings.baseline_threads) as pool:
        for sample in bounded_map(pool, load_sample, [files[i] for i in order], 2 * settings.baseline_threads):
            tokens += len(sample["input_ids"])
            rows += packer.add(sample)
    return {"seconds": time.perf_counter() - started, "setup_s": setup, "tokens": tokens, "batches": rows + 1}


def read_store(root: Path, seed: int, settings: Settings, decode: bool) -> dict[str, float]:
    started = time.perf_counter()
    store = hsstore.open_store(str(root))
    reads: list[tuple[int, int]] = []  # (start, stop) of every read the loader issues
    read_token_range = store.read_token_range

    def counted(shard_id: str, start: int, stop: int, features: Any = None, **kwargs: Any) -> dict[str, np.ndarray]:
        reads.append((start, stop))  # list.append is atomic under the GIL
        return read_token_range(shard_id, start, stop, features, **kwargs)

    store.read_token_range = counted  # type: ignore[method-assign]
    loader = StreamingLoader(
        store,
        list(FEATURES),
        token_budget=settings.token_budget,
        seed=seed,
        shuffle_window=settings.shuffle_window,
        read_threads=settings.read_threads,
        prefetch_batches=settings.prefetch_batches,
        # A CPU consumer: fp8 is decoded by the loader's assembler thread, overlapping the reads.
        decode_on_host=decode,
    )
    loader.num_batches(0)
    setup = time.perf_counter() - started
    tokens = batches = 0
    decode_s = 0.0
    for batch in loader.batches(max_epochs=1):
        if decode:
            t = time.perf_counter()
            on_cpu = to_device(batch, loader.specs, "cpu")
            assert on_cpu.features[FEATURES[0]].dtype == torch.bfloat16
            decode_s += time.perf_counter() - t
        tokens += batch.num_real_tokens
        batches += 1
        batch.release()  # done with it: its buffers take a later batch (no fresh allocation)
    seconds = time.perf_counter() - started
    chunk_tokens = store.features[FEATURES[0]].chunk_tokens or 1
    chunks = sum((stop - 1) // chunk_tokens - start // chunk_tokens + 1 for start, stop in reads if stop > start)
    return {
        "seconds": seconds, "setup_s": setup, "tokens": tokens, "batches": batches, "decode_s": decode_s,
        "reads": len(reads), "tokens_per_read": sum(b - a for a, b in reads) / max(1, len(reads)),
        # tokens the inner chunks touched hold, over the tokens asked for: what whole-chunk reads cost
        "chunk_amplification": chunks * chunk_tokens / max(1, sum(b - a for a, b in reads)),
    }


# -- machine load ---------------------------------------------------------------------------------


def busy_cpu_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return usage.ru_utime + usage.ru_stime


def measured(fn: Any, *args: Any) -> dict[str, float]:
    """Runs ``fn`` and adds this process's CPU seconds and the share of the machine that *other*
    processes used meanwhile (the machine is shared: numbers taken under load say so)."""
    busy0, own0, wall0 = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    run = fn(*args)
    wall = time.perf_counter() - wall0
    own = own_cpu_seconds() - own0
    run["cpu_s"] = own
    run["others_cpu_frac"] = max(0.0, busy_cpu_seconds() - busy0 - own) / (wall * (os.cpu_count() or 1))
    return run


# -- page cache -----------------------------------------------------------------------------------


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (``fincore``), or None where fincore is missing."""
    if not shutil.which("fincore") or not files:
        return None
    total = 0
    for start in range(0, len(files), 500):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *map(str, files[start : start + 500])],
            capture_output=True, text=True, check=True,
        ).stdout
        total += sum(int(line) for line in out.split())
    return total


def drop_cache(root: Path, method: str) -> None:
    os.sync()
    if method == "drop":
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    for path in list_files(root):  # fadvise: only this layout's files leave the cache
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


BLKIO = Path("/sys/fs/cgroup/blkio")


@contextlib.contextmanager
def throttled_disk(root: Path, mbps: int) -> Iterator[None]:
    """Run the body with this process's block-device reads limited to ``mbps`` MB/s (cgroup v1
    blkio throttle on the device holding ``root``): a disk or network filesystem slower than this
    VM's, whose "cold" reads are served at ~3 GB/s from the host's cache (dd after drop_caches).
    Only real device reads are throttled; the page cache is not."""
    group = BLKIO / "hsstore-bench"
    group.mkdir(exist_ok=True)
    dev = os.stat(root).st_dev
    (group / "blkio.throttle.read_bps_device").write_text(f"{os.major(dev)}:{os.minor(dev)} {mbps * 1_000_000}\n")
    (group / "cgroup.procs").write_text(f"{os.getpid()}\n")  # the whole process, every thread
    try:
        yield
    finally:
        (BLKIO / "cgroup.procs").write_text(f"{os.getpid()}\n")


def choose_cold_method(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop"
    except OSError:
        return "fadvise"


# -- one hidden size ------------------------------------------------------------------------------


def data_files_per_million(layout: str, hidden: int, settings: Settings, mean_len: float) -> float:
    """Files per million tokens at scale (a store of many full store shards), from the settings."""
    if layout == BASELINE:
        return 1e6 / mean_len
    per_shard = 2  # samples.arrow + the features.zarr group's zarr.json
    for spec in store_specs(layout, hidden, settings):
        for name in spec.array_names():
            shard_tokens = spec.shard_tokens
            if shard_tokens is not None and name != spec.name:
                shard_tokens *= SCALE_GROUPING
            # zarr.json + data files (one per store shard when shard_chunks is None)
            per_shard += 1 + (1 if shard_tokens is None else -(-settings.shard_max_tokens // shard_tokens))
    return per_shard * 1e6 / settings.shard_max_tokens


def run_hidden(hidden: int, settings: Settings, cold_method: str, log: Any) -> dict[str, Any]:
    bf16_bytes_per_token = (NUM_AUX + 1) * hidden * 2
    total_tokens = int(settings.gib[hidden] * (1 << 30) / bf16_bytes_per_token)
    t = time.perf_counter()
    samples = make_samples(hidden, total_tokens, settings)
    num_tokens = sum(len(s.input_ids) for s in samples)
    log(f"H={hidden}: {len(samples)} samples, {num_tokens} tokens, {num_tokens * bf16_bytes_per_token / 1e9:.2f} GB bf16 "
        f"features (generated in {time.perf_counter() - t:.1f}s)")
    assert settings.workdir is not None, "main() picks the working folder"
    roots = {layout: settings.workdir / f"h{hidden}" / layout.replace(" ", "_").replace("+", "-") for layout in settings.layouts}
    results: dict[str, dict[str, Any]] = {layout: {"write": [], "cold": [], "warm": [], "cold_bits": [], "warm_bits": [], "slow": [], "slow_bits": [], "resident_before_cold": []} for layout in settings.layouts}

    for rep in range(settings.write_repeats):
        for layout in settings.layouts:
            timing = measured(timed_write, roots[layout], layout, samples, settings)
            results[layout]["write"].append(timing)
            log(f"  write {layout:22s} rep {rep}: {timing['synced_s']:.2f}s ({timing['buffered_s']:.2f}s buffered, "
                f"cpu {timing['cpu_s']:.2f}s, others {100 * timing['others_cpu_frac']:.0f}%)")
    num_samples = len(samples)
    mean_len = num_tokens / num_samples
    del samples

    def one_read(layout: str, seed: int, decode: bool) -> dict[str, float]:
        if layout == BASELINE:
            return read_per_sample(roots[layout], hidden, seed, settings)
        return read_store(roots[layout], seed, settings, decode)

    modes = [("cold", True), ("warm", True)]
    if settings.bits_only:
        modes += [("cold_bits", False), ("warm_bits", False)]
    if settings.disk_mbps and cold_method == "drop" and not BLKIO.is_dir():
        log(f"no cgroup v1 blkio controller at {BLKIO}: skipping the cold epochs at {settings.disk_mbps} MB/s")
    elif settings.disk_mbps and cold_method == "drop":
        modes += [("slow", True)] + ([("slow_bits", False)] if settings.bits_only else [])
    for mode, decode in modes:
        layouts = [lay for lay in settings.layouts if decode or lay != BASELINE]
        if mode.startswith(("cold", "slow")) and cold_method == "skip":
            continue
        if mode.startswith("warm"):
            for layout in layouts:  # warm-up epoch, untimed
                one_read(layout, settings.seed, decode)
            for layout in layouts:  # what stayed cached (other processes compete for memory)
                files = list_files(roots[layout])
                resident = resident_bytes(files)
                if resident is not None:
                    results[layout].setdefault("resident_frac_before_warm", []).append(
                        min(1.0, resident / max(1, sum(f.stat().st_size for f in files))))  # pages round up
        for rep in range(settings.repeats):
            for layout in layouts:
                if mode.startswith(("cold", "slow")):
                    drop_cache(roots[layout], cold_method)
                    if rep == 0:  # check the drop worked, then drop again: fincore opened every file
                        results[layout]["resident_before_cold"].append(resident_bytes(list_files(roots[layout])))
                        drop_cache(roots[layout], cold_method)
                throttle = throttled_disk(roots[layout], settings.disk_mbps) if mode.startswith("slow") else contextlib.nullcontext()
                with throttle:
                    run = measured(one_read, layout, settings.seed + 1 + rep, decode)
                run["tokens_per_s"] = run["tokens"] / run["seconds"]
                results[layout][mode].append(run)
                log(f"  {mode:9s} {layout:22s} rep {rep}: {run['tokens_per_s']:9.0f} tokens/s "
                    f"({run['seconds']:.2f}s, cpu {run['cpu_s']:.2f}s, decode {run.get('decode_s', 0):.2f}s, "
                    f"others {100 * run['others_cpu_frac']:.0f}%)")

    summary: dict[str, Any] = {}
    for layout in settings.layouts:
        r = results[layout]
        files = list_files(roots[layout])
        disk_bytes = sum(f.stat().st_size for f in files)
        write_s = statistics.median(w["synced_s"] for w in r["write"])
        row = {
            "write_s": write_s,
            "write_mb_s": num_tokens * bf16_bytes_per_token / write_s / 1e6,
            "write_tokens_s": num_tokens / write_s,
            "write_buffered_s": statistics.median(w["buffered_s"] for w in r["write"]),
            "bytes_per_token": disk_bytes / num_tokens,
            "disk_bytes": disk_bytes,
            "files": len(files),
            "files_per_mtok": len(files) * 1e6 / num_tokens,
            "files_per_mtok_at_scale": data_files_per_million(layout, hidden, settings, mean_len),
        }
        row["write_tokens_per_cpu_s"] = num_tokens / statistics.median(w["cpu_s"] for w in r["write"])
        for mode in ("cold", "warm", "cold_bits", "warm_bits", "slow", "slow_bits"):
            if r.get(mode):
                row[f"{mode}_tokens_s"] = statistics.median(x["tokens_per_s"] for x in r[mode])
                row[f"{mode}_tokens_s_range"] = [min(x["tokens_per_s"] for x in r[mode]), max(x["tokens_per_s"] for x in r[mode])]
                row[f"{mode}_tokens_per_cpu_s"] = statistics.median(x["tokens"] / x["cpu_s"] for x in r[mode])
                row[f"{mode}_others_cpu_frac"] = statistics.median(x["others_cpu_frac"] for x in r[mode])
        if r["warm"] and "reads" in r["warm"][0]:
            row["tokens_per_read"] = statistics.median(x["tokens_per_read"] for x in r["warm"])
            row["chunk_amplification"] = statistics.median(x["chunk_amplification"] for x in r["warm"])
        if r["resident_before_cold"]:
            row["resident_bytes_before_cold"] = r["resident_before_cold"][0]
        if r.get("resident_frac_before_warm"):
            row["resident_frac_before_warm"] = min(r["resident_frac_before_warm"])
        summary[layout] = row
    base = summary.get(BASELINE)
    if base:
        for row in summary.values():
            for mode in ("cold", "warm", "cold_bits", "warm_bits", "slow", "slow_bits"):
                ref = base.get(f"{mode}_tokens_s") or base.get(f"{mode.split('_')[0]}_tokens_s")
                if f"{mode}_tokens_s" in row and ref:
                    row[f"{mode}_vs_baseline"] = row[f"{mode}_tokens_s"] / ref
            row["files_reduction_at_scale"] = base["files_per_mtok_at_scale"] / row["files_per_mtok_at_scale"]
            row["bytes_vs_baseline"] = row["bytes_per_token"] / base["bytes_per_token"]
    return {"hidden": hidden, "disk_mbps": settings.disk_mbps, "num_samples": num_samples, "num_tokens": num_tokens, "mean_len": mean_len,
            "summary": summary, "runs": results}


# -- output ---------------------------------------------------------------------------------------


def markdown_table(result: dict[str, Any]) -> str:
    def num(value: float | None, fmt: str = "{:,.0f}") -> str:
        return "-" if value is None else fmt.format(value)

    def ratio(value: float | None) -> str:
        return "" if value is None else f" ({value:.2f}x)"

    lines = [
        f"H={result['hidden']}: {result['num_samples']:,} samples, {result['num_tokens']:,} tokens "
        f"(mean {result['mean_len']:.0f}/sample); medians; (x) = ratio to per-sample bf16",
        "",
        "| layout | write MB/s | write tok/s | cold tok/s | warm tok/s | cold bits-only tok/s | warm bits-only tok/s | bytes/token | files (here) | files per Mtok at scale |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout, row in result["summary"].items():
        reduction = row.get("files_reduction_at_scale")
        lines.append(
            f"| {layout} | {num(row['write_mb_s'])} | {num(row['write_tokens_s'])} "
            f"| {num(row.get('cold_tokens_s'))}{ratio(row.get('cold_vs_baseline'))} "
            f"| {num(row.get('warm_tokens_s'))}{ratio(row.get('warm_vs_baseline'))} "
            f"| {num(row.get('cold_bits_tokens_s'))}{ratio(row.get('cold_bits_vs_baseline'))} "
            f"| {num(row.get('warm_bits_tokens_s'))}{ratio(row.get('warm_bits_vs_baseline'))} "
            f"| {num(row['bytes_per_token'])}{ratio(row.get('bytes_vs_baseline'))} | {row['files']} "
            f"| {num(row['files_per_mtok_at_scale'], '{:,.1f}')}"
            f"{'' if reduction is None else f' (1/{reduction:.0f})'} |"
        )
    if any("slow_tokens_s" in row for row in result["summary"].values()):
        lines += [
            "",
            f"Cold, disk reads throttled to {result.get('disk_mbps', '?')} MB/s (blkio cgroup): tok/s, (x) = ratio to per-sample bf16",
            "",
            "| layout | cold @disk tok/s | cold @disk bits-only tok/s |",
            "|---|---:|---:|",
        ]
        for layout, row in result["summary"].items():
            lines.append(
                f"| {layout} | {num(row.get('slow_tokens_s'))}{ratio(row.get('slow_vs_baseline'))} "
                f"| {num(row.get('slow_bits_tokens_s'))}{ratio(row.get('slow_bits_vs_baseline'))} |"
            )
    lines += [
        "",
        "Per CPU-second of this process (less disturbed by other load than wall time, not immune) and how the runs went:",
        "",
        "| layout | write tok/cpu-s | cold tok/cpu-s | warm tok/cpu-s | warm bits-only tok/cpu-s | others' CPU cold / warm | tokens per read | chunk amplification | resident before cold / warm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout, row in result["summary"].items():
        others = [row.get(f"{m}_others_cpu_frac") for m in ("cold", "warm")]
        resident = row.get("resident_bytes_before_cold")
        warm_frac = row.get("resident_frac_before_warm")
        lines.append(
            f"| {layout} | {num(row['write_tokens_per_cpu_s'])} | {num(row.get('cold_tokens_per_cpu_s'))} "
            f"| {num(row.get('warm_tokens_per_cpu_s'))} | {num(row.get('warm_bits_tokens_per_cpu_s'))} "
            f"| {' / '.join('-' if o is None else f'{100 * o:.0f}%' for o in others)} "
            f"| {num(row.get('tokens_per_read'))} | {num(row.get('chunk_amplification'), '{:.2f}')} "
            f"| {'-' if resident is None else f'{resident / 1e6:.1f} MB'} / {num(warm_frac, '{:.0%}')} |"
        )
    return "\n".join(lines)


def parse_chunk_tokens(text: str, hidden_sizes: list[int]) -> dict[int, int]:
    """``"256"`` (every hidden size) or ``"4096:256,384:1024"``; empty or 0: FeatureSpec's default."""
    if not text.strip():
        return {}
    if ":" not in text:
        return {h: int(text) for h in hidden_sizes if int(text)}
    pairs = (item.split(":") for item in text.split(",") if item.strip())
    return {int(h): int(n) for h, n in pairs}


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats (a couple of minutes)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--workdir", type=Path, help="where layouts are written (default: a new /tmp/hsstore-bench-*; removed at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the written layouts")
    parser.add_argument("--hidden", default="4096,384", help="comma-separated hidden sizes")
    parser.add_argument("--gib", type=float, help="bf16 GiB of features per layout (default: 1.5 at H=4096, 0.5 at H=384, else 0.25)")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per layout and mode")
    parser.add_argument("--write-repeats", type=int, default=3)
    parser.add_argument("--layouts", default=",".join([BASELINE, *STORE_CODECS]), help="comma-separated subset")
    parser.add_argument("--token-budget", type=int, default=4096, help="tokens per packed row (one row per batch)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--mean-len", type=int, default=600)
    parser.add_argument("--read-threads", type=int, default=4, help="store reads in flight")
    parser.add_argument("--prefetch-batches", type=int, default=4)
    parser.add_argument("--baseline-threads", type=int, default=4, help="per-sample loads in flight")
    parser.add_argument("--shuffle-window", type=int, default=1024, help="samples (loader)")
    parser.add_argument("--chunk-tokens", default="", help="tokens per inner chunk: N for every hidden size, or H:N,H:N (default and hidden sizes not named: FeatureSpec's default)")
    parser.add_argument("--shard-chunks", type=int, default=0, help="inner chunks per Zarr shard file; 0: one file per array per store shard (the default)")
    parser.add_argument("--compression-level", type=int, default=1)
    parser.add_argument("--shard-max-tokens", type=int, default=4 << 20, help="tokens per store shard (also what 'files per Mtok at scale' assumes)")
    parser.add_argument("--cold", choices=["auto", "drop", "fadvise", "skip"], default="auto")
    parser.add_argument("--disk-mbps", type=int, default=500, help="also time cold epochs with disk reads throttled to this many MB/s (needs root and cgroup v1 blkio; 0: skip)")
    parser.add_argument("--no-bits-only", action="store_true", help="skip the undecoded store epochs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    hidden_sizes = [int(h) for h in args.hidden.split(",")]
    gib = {h: args.gib if args.gib is not None else DEFAULT_GIB.get(h, 0.25) for h in hidden_sizes}
    repeats, write_repeats = args.repeats, args.write_repeats
    if args.quick:
        gib = {h: min(g, 0.25 if h >= 1024 else 0.08) for h, g in gib.items()}
        repeats, write_repeats = min(repeats, 2), 1
    layouts = [name.strip() for name in args.layouts.split(",")]
    unknown = [name for name in layouts if name != BASELINE and name not in STORE_CODECS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {[BASELINE, *STORE_CODECS]}")
    settings = Settings(
        hidden_sizes=hidden_sizes, gib=gib, repeats=repeats, write_repeats=write_repeats, layouts=layouts,
        token_budget=args.token_budget, max_len=args.max_len, mean_len=args.mean_len,
        read_threads=args.read_threads, prefetch_batches=args.prefetch_batches,
        baseline_threads=args.baseline_threads, shuffle_window=args.shuffle_window,
        chunk_tokens=parse_chunk_tokens(args.chunk_tokens, hidden_sizes), shard_chunks=args.shard_chunks or None,
        compression_level=args.compression_level, shard_max_tokens=args.shard_max_tokens,
        cold=args.cold, disk_mbps=args.disk_mbps, bits_only=not args.no_bits_only, seed=args.seed, workdir=args.workdir,
    )
    return settings, args


def compare_layouts(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    if settings.token_budget < settings.max_len:
        print(f"--token-budget {settings.token_budget} must hold the longest sample (--max-len {settings.max_len})", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    if settings.workdir is None:  # a fresh folder per run: two runs sharing one delete each other's layouts
        settings = dataclasses.replace(settings, workdir=Path(tempfile.mkdtemp(prefix="hsstore-bench-")))
    machine = machine_info()  # now: the hsstore commit imported, not one landed during the run
    cold_method = choose_cold_method(settings.cold)
    log(f"cold reads: {cold_method}; settings: {settings}")
    settings.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for hidden in settings.hidden_sizes:
            results.append(run_hidden(hidden, settings, cold_method, log))
    finally:
        if not args.keep:
            shutil.rmtree(settings.workdir, ignore_errors=True)
    report = {
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else f"bench_store.py {' '.join(argv)}",
        "machine": machine,
        "cold_method": cold_method,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in settings.__dict__.items()},
        "wall_s": time.perf_counter() - started,
        "results": results,
    }
    for result in results:
        print()
        print(markdown_table(result))
    print(f"\ntotal {report['wall_s']:.0f}s; hsstore {report['machine']['hsstore_commit']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.out, report, indent=1)
    return 0


# Modes: ``python -m benchmarks.bench_store MODE --help``; without a mode, :func:`compare_layouts` runs.
MODES = {
    "compact-preset": "benchmarks.store.compact_preset",
    "compact-bytes": "benchmarks.store.compact_bytes",
    "layer-subset": "benchmarks.store.layer_subset",
    "shard-write": "benchmarks.store.shard_write",
    "import": "benchmarks.store.import_dump",
}


def main(argv: list[str] | None = None) -> int:
    return run_modes(argv, compare_layouts, MODES, prog="python -m benchmarks.bench_store")


if __name__ == "__main__":
    # SIGTERM (a killed run) still removes what the run wrote: the layouts are GBs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
