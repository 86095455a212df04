"""The worker's start-up warm-up: one batch of the largest planned shape before any unit.

Why: the first forwards of a process pay for CUDA loading its kernels, cuBLAS creating its handles
and the caching allocator growing its pools; the warm-up makes that happen while the worker starts
(as a serving engine warms up before it takes requests), not in the first unit. It is also the
memory check: a token budget the device cannot hold fails then, naming the setting, instead of as
an out-of-memory in the first unit. The worker runs it (``ExtractionWorker.warm_up``); the pieces
that do not need the worker live here.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from hsstore import FeatureSpec, ShardWriter
from hsstore.errors import HsstoreError
from hsstore.format.codecs import encode_torch
from pipelines.extract.batching import round_up
from pipelines.extract.errors import ExtractionError
from pipelines.extract.sink import HostBufferPool, ShardSink
from pipelines.extract.units import SampleRow, unit_shard_id
from pipelines.extract.worker_spec import WorkerSpec

# Tokens of the warm-up batch written through a throwaway shard (write_throwaway_shard): enough to
# fill a few chunks of every array, so every code path of a write runs once.
WARM_WRITE_TOKENS = 1024


def warm_shape(spec: WorkerSpec) -> tuple[int, int]:
    """``(rows, length)`` of the warm-up batch: the largest batch the plan can make, as many
    rows of the longest sample as the token budget holds (batching.plan_batches' limits)."""
    budget = spec.token_budget
    length = min(spec.max_length or budget, budget)
    length = round_up(length, spec.pad_to_multiple_of)
    rows = max(1, budget // length)
    if spec.max_batch_size:
        rows = min(rows, spec.max_batch_size)
    return rows, length


def copy_through_host_buffers(
    features: dict[str, torch.Tensor],
    specs: tuple[FeatureSpec, ...],
    host_buffers: HostBufferPool,
    num_tokens: int,
    device: torch.device,
) -> None:
    """Encode the features on their device and copy them into a set of host buffers, as a unit's
    batch is: the GPU encode kernels and the pinned copies run once before any unit."""
    buffers = host_buffers.acquire(num_tokens)
    try:
        for spec in specs:
            for name, bits in encode_torch(spec, features[spec.name]).items():
                buffers[name][:num_tokens].copy_(bits, non_blocking=True)
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies are over: the set is free
        host_buffers.release(buffers)


def write_throwaway_shard(
    features: dict[str, torch.Tensor],
    specs: tuple[FeatureSpec, ...],
    host_buffers: HostBufferPool,
    device: torch.device,
) -> None:
    """A few of the warm-up batch's rows through a sink into a throwaway local shard.

    What a unit's first batch would otherwise set up while the GPU waits for it: the store
    code's imports (zarr, its codecs), a ShardWriter's threads and chunk buffers, the sink's
    writer thread and copy stream. Measured on an H200: the GPU's first forward of a run ran
    0.85-1.2 s after the first unit began when only the forward was warmed (RESULTS.md,
    issue 13). The shard is written to a temporary folder and removed: nothing reaches the store.
    """
    tokens = min(WARM_WRITE_TOKENS, *(t.shape[0] for t in features.values()))
    row = SampleRow(
        "warm-up", "warm-up", np.zeros(tokens, dtype=np.int32), np.ones(tokens, dtype=np.uint8)
    )
    try:
        folder = tempfile.mkdtemp(prefix="hsstore-warm-up-")
    except OSError as err:
        raise ExtractionError(
            f"the warm-up's throwaway shard: no temporary folder in {tempfile.gettempdir()} "
            f"({err}); point TMPDIR at a writable local folder"
        ) from err
    try:
        writer = ShardWriter(folder, unit_shard_id(0), list(specs))
        sink = ShardSink(writer, device, pool=host_buffers, max_pending_batches=1)
        try:
            sink.submit([row], {name: t[:tokens] for name, t in features.items()})
            sink.finish()
        except BaseException:
            sink.abort()
            raise
    except (OSError, HsstoreError) as err:
        raise ExtractionError(
            f"the warm-up's throwaway shard in {folder} could not be written ({err}); "
            "point TMPDIR at a writable local folder with room for it"
        ) from err
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def timed_on_thread(fn: Callable[[], None]) -> Future:
    """``fn`` on a thread of its own, started now (the worker pins its host buffers while the
    model loads); the future gives its seconds."""
    def timed() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(timed)
    finally:
        pool.shutdown(wait=False)
