"""The extraction worker: owns the target model and turns work units into shards.

One worker per GPU (a Ray actor) or one in process (the local executor): the same class either
way, so a profile of the in-process run is a profile of what the actors do. A unit is one shard
with a deterministic id (``units.unit_shard_id``), written to its own attempt folder; only the
driver's manifest commit makes it visible (hsstore's ShardWriter contract). The worker's other
concerns live beside it: the unit types (units.py, torch-free), loading the target (target.py),
the warm-up (warm_up.py), isolating a record the target raises on (isolation.py) and the GPU's
own timing of the forwards (gpu_timing.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from hsstore import ShardWriter
from hsstore.errors import HsstoreError
from pipelines.extract import compiled_layers
from pipelines.extract import warm_up as start_up
from pipelines.extract.batching import Batch, collate, plan_batches
from pipelines.extract.capture import HiddenStateCapture, resolve_pass_attention_mask
from pipelines.extract.errors import ExtractionError
from pipelines.extract.gpu_timing import GpuClock, GpuTimeline
from pipelines.extract.isolation import (
    describe,
    is_out_of_memory,
    raise_if_device_broken,
    raise_if_every_sample_failed,
    rejected_sample,
    rerun_alone,
)
from pipelines.extract.profiling import BATCH, SUBMIT, UNIT_FLUSH, UNIT_SETUP, FirstBatchesProfiler
from pipelines.extract.sink import HostBufferPool, ShardSink
from pipelines.extract.target import load_worker_target, resolve_device
from pipelines.extract.units import UnitResult, WorkerStartup, WorkUnit
from pipelines.extract.warm_up import copy_through_host_buffers, warm_shape, write_throwaway_shard
from pipelines.extract.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

# Batches queued between the forwards and a shard's writer thread (bounds pinned host memory).
MAX_PENDING_BATCHES = 3


class ExtractionWorker:
    """Loads the target once; :meth:`run_unit` writes one unit's shard and returns its record."""

    def __init__(self, spec: WorkerSpec, model: torch.nn.Module | None = None):
        """``model``: an already loaded target (benchmarks, tests); default: load ``spec.target``."""
        entered_at = time.time()  # a Ray actor's process is up and its modules imported
        self.spec = spec
        self.device = resolve_device(spec.device)  # where features are gathered and copied from
        self.input_device = self.device  # where token ids go (the embeddings' device)
        # Pinned host buffers for the device-to-host copies, shared by the units in flight: as
        # many as the sink's queue holds plus the one being written and the one being copied;
        # pinned (seconds for the 8B shape) on a thread while the model loads.
        self.host_buffers = HostBufferPool(
            spec.features, spec.token_budget, MAX_PENDING_BATCHES + 2, pin=self.device.type == "cuda"
        )
        pinning = start_up.timed_on_thread(self.host_buffers.preallocate) if self.device.type == "cuda" else None
        load_start, load_seconds = time.perf_counter(), 0.0
        if model is None:
            model, self.input_device, self.device = load_worker_target(spec, self.device)
            load_seconds = time.perf_counter() - load_start
        self.model = model
        buffers_seconds = pinning.result() if pinning else 0.0
        # Every forward (the warm-up's included) runs on this one thread: _on_compute_thread.
        self._compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forwards")
        self._last_forward_end: torch.cuda.Event | None = None  # the previous unit's, on a GPU
        self._gpu_clock: GpuClock | None = None  # set by the warm-up
        self.profiler = FirstBatchesProfiler(spec.profile_dir, spec.profile_batches, self.device)
        self.capture = HiddenStateCapture(
            self.model,
            spec.aux_layer_ids,
            final_hidden_state=spec.final_hidden_state,
            topk_k=spec.topk_k,
            topk_chunk_tokens=spec.topk_chunk_tokens,
            pass_attention_mask=resolve_pass_attention_mask(
                spec.pass_attention_mask,
                getattr(getattr(self.model, "config", None), "model_type", None),
            ),
        )
        # Compiled (model.compile) in the background after an eager warm-up (compiled_layers.py).
        self.compiled = (
            compiled_layers.CompiledDecoderLayers(
                self.capture.parts.layers, deferred=True, backend=spec.compile_backend
            )
            if compiled_layers.resolve_compile(spec.compile, self.device)
            else None
        )
        self.warmup_seconds = self._start()
        self.startup = WorkerStartup(
            load_seconds, self.warmup_seconds, compiled=self.compiled is not None, ready_at=time.time(),
            entered_at=entered_at, buffers_seconds=buffers_seconds,
        )

    def _start(self) -> float:
        """The warm-up, on a GPU or with compiled layers (eager: the first layer's inputs are
        recorded), then the layers compiled in the background from those inputs."""
        if self.device.type != "cuda" and self.compiled is None:
            return 0.0
        if self.compiled is None:
            return self._on_compute_thread(self.warm_up)
        self.compiled.record_calls()
        seconds = self._on_compute_thread(self.warm_up)
        self.compiled.compile_in_background(self.device, wait=not self.spec.compile_in_background)
        self.compiled.ready(fail_quietly=self.spec.compile == "auto")  # raises a failure already known
        return seconds

    def warm_up(self) -> float:
        """One batch of the largest shape (:func:`warm_up.warm_shape`) through capture, GPU encode,
        copy and a throwaway shard, before any unit (warm_up.py says why); with compiled layers,
        the forwards whose layer inputs the background compile replays (all eager). Returns its
        seconds."""
        rows, length = warm_shape(self.spec)
        start = time.perf_counter()
        try:
            if self.compiled is not None:
                compiled_layers.compile_warm_up(
                    self._pad_forward, rows, length, self.spec.pad_to_multiple_of, self.capture.pass_attention_mask
                )
            features = self._pad_forward(rows, length)
            copy_through_host_buffers(
                features, self.spec.features, self.host_buffers, rows * length, self.device
            )
            write_throwaway_shard(features, self.spec.features, self.host_buffers, self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self._gpu_clock = GpuClock.start(self.device)
        except ExtractionError:
            raise
        except Exception as err:
            if is_out_of_memory(err):
                raise ExtractionError(
                    f"the warm-up batch ({rows} x {length} tokens, batching.token_budget="
                    f"{self.spec.token_budget}) ran out of memory on {self.device}: lower "
                    "batching.token_budget (or batching.max_length), or use a larger device"
                ) from err
            raise ExtractionError(f"the target failed its warm-up batch: {describe(err)}") from err
        seconds = time.perf_counter() - start
        logger.info("warmed up on a %d x %d batch in %.2f s", rows, length, seconds)
        return seconds

    def run_unit(
        self, unit: WorkUnit, on_batch: Callable[[int, int], None] | None = None
    ) -> UnitResult:
        """Run the target over a unit and write its shard (not committed: the driver does that).

        Thread-safe, and meant to be called from two threads: the forwards run on the worker's
        compute thread, one unit at a time, but finishing a shard (last flushes, sample table,
        checksumming every file: seconds for GBs) happens in the calling thread, so the next
        unit's forwards overlap it.
        ``on_batch(num_samples, num_tokens)`` is called after each batch (progress bars).

        A sample the target raises on alone is left out and returned in ``rejected``; anything
        else that raises is an :class:`ExtractionError` naming the unit (hsstore's own errors,
        a failed shard write among them, already name the shard and pass unchanged).
        """
        try:
            return self._run_unit(unit, on_batch)
        except HsstoreError:
            raise
        except Exception as err:
            raise ExtractionError(
                f"unit {unit.index} (shard {unit.shard_id}) failed: {describe(err)}"
            ) from err

    def _run_unit(self, unit: WorkUnit, on_batch: Callable[[int, int], None] | None) -> UnitResult:
        start = time.perf_counter()
        # The forwards on the worker's one compute thread (units queue there, one at a time);
        # finishing the shard here, in the caller's thread, overlapping the next unit's forwards.
        done = self._on_compute_thread(self._compute_unit, unit, on_batch)
        try:
            record = done.sink.finish()
        except BaseException:
            done.sink.abort()
            raise
        # Every copy is done, so every forward the unit's events enclose is over.
        gpu_forward_seconds, gpu_between_seconds = done.timeline.seconds(done.previous_end)
        gpu_started_at, gpu_ended_at = done.timeline.wall_span(self._gpu_clock)
        kept = done.kept
        return UnitResult(
            unit_index=unit.index,
            record=record,
            num_samples=sum(len(b.indices) for b in kept),
            num_tokens=sum(b.num_tokens for b in kept),
            num_padded_tokens=sum(b.num_padded_tokens for b in kept),
            num_batches=len(kept),
            seconds=time.perf_counter() - start,
            compute_seconds=done.compute_seconds,
            write_seconds=done.sink.write_seconds,
            copy_wait_seconds=done.sink.wait_seconds,
            pool_wait_seconds=done.sink.pool_wait_seconds,
            compute_started_at=done.started_at,
            compute_ended_at=done.ended_at,
            landed_at=done.sink.landed_at,
            gpu_forward_seconds=gpu_forward_seconds,
            gpu_between_seconds=gpu_between_seconds,
            gpu_started_at=gpu_started_at,
            gpu_ended_at=gpu_ended_at,
            rejected=tuple(rejected_sample(unit, i, error) for i, error in sorted(done.failures)),
            compiled=done.compiled,
            compiled_graphs=self.compiled.num_graphs if self.compiled else 0,
            compile_seconds=self.compiled.compile_seconds if self.compiled else 0.0,
        )

    def _on_compute_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the compute thread and wait for it (its exception is raised here).

        Why one thread: CUDA keeps per-thread state that a forward needs (PyTorch's cuBLAS handles
        and workspaces), so a forward on a fresh thread pays for setting it up again; Ray and
        LocalExecutor call from threads of their own choosing.
        """
        return self._compute_thread.submit(fn, *args).result()

    def _open_sink(self, unit: WorkUnit) -> ShardSink:
        """The unit's shard writer behind a sink that overlaps writing with the next forwards."""
        writer = ShardWriter(
            self.spec.store,
            unit.shard_id,
            list(self.spec.features),
            storage_options=self.spec.storage_options,
        )
        return ShardSink(
            writer,
            self.device,
            pool=self.host_buffers,
            max_pending_batches=MAX_PENDING_BATCHES,
            copy_pieces=len(self.capture.pace_layers),
        )

    def _compute_unit(self, unit: WorkUnit, on_batch: Callable[[int, int], None] | None) -> _ComputedUnit:
        """The unit's forwards, on the compute thread: each batch's features go to the unit's sink."""
        compute_start = time.perf_counter()
        started_at = time.time()
        compiled = self.compiled is not None and self.compiled.ready(fail_quietly=self.spec.compile == "auto")
        with self.profiler.unit(unit.index):  # traced: the first unit only, with profiler.dir set
            token_ids = [row.input_ids for row in unit.rows]
            kept: list[Batch] = []  # the forwards whose features went to the shard
            failures: list[tuple[int, str]] = []  # (position in the unit, the error) of left-out rows
            with record_function(UNIT_SETUP):
                batches = plan_batches(
                    [len(ids) for ids in token_ids],
                    self.spec.token_budget,
                    max_batch_size=self.spec.max_batch_size,
                    pad_to_multiple_of=self.spec.pad_to_multiple_of,
                )
                # One GPU only: a target split over several has its forwards on more than one stream.
                timeline = GpuTimeline(self.device if self.input_device == self.device else None)
                sink = self._open_sink(unit)
            if self.device.type == "cuda":
                self.capture.on_pace = sink.pace  # this unit's copies ride its next forwards
            try:
                for batch in batches:
                    with record_function(BATCH):
                        num_samples, num_tokens = self._batch(unit, token_ids, batch, timeline, sink, kept, failures)
                    self.profiler.batch_done()
                    if on_batch is not None and num_samples:
                        on_batch(num_samples, num_tokens)
                raise_if_every_sample_failed(unit, kept, failures)
                if self.device.type == "cuda":
                    # The last batch has no next forward in this unit: its copy goes now, in one
                    # piece, and the next unit's forwards pace only its own batches.
                    with record_function(UNIT_FLUSH):
                        sink.flush_copies()
            except BaseException:
                sink.abort()
                raise
            finally:
                self.capture.on_pace = None
        previous_end = self._last_forward_end
        self._last_forward_end = timeline.last_end or previous_end
        return _ComputedUnit(
            sink=sink,
            kept=kept,
            failures=failures,
            timeline=timeline,
            previous_end=previous_end,
            compute_seconds=time.perf_counter() - compute_start,
            started_at=started_at,
            ended_at=time.time(),
            compiled=compiled,
        )

    def _batch(
        self,
        unit: WorkUnit,
        token_ids: list[Any],
        batch: Batch,
        timeline: GpuTimeline,
        sink: ShardSink,
        kept: list[Batch],
        failures: list[tuple[int, str]],
    ) -> tuple[int, int]:
        """One batch's forward, its features to the sink; its samples rerun alone if it raised.
        Returns the samples and tokens it added to the shard (``kept`` and ``failures`` grow)."""
        failed = False
        try:
            with timeline.forward():
                features = self._forward(token_ids, batch)
        except Exception as err:
            raise_if_device_broken(unit, batch, err)
            logger.warning(
                "unit %d: a batch of %d samples failed (%s); rerunning them alone",
                unit.index,
                len(batch.indices),
                describe(err),
            )
            failed = True
        # Isolation runs outside the except block: the exception's traceback holds the failed
        # forward's activations, which the reruns need the memory of.
        if failed:
            singles, batch_failures = self._isolate(unit, token_ids, batch, sink)
            kept.extend(singles)
            failures.extend(batch_failures)
            return len(singles), sum(b.num_tokens for b in singles)
        # Submitted only now that every row's features exist: a failed forward adds nothing
        # to the shard.
        with record_function(SUBMIT):
            sink.submit([unit.rows[i] for i in batch.indices], features)
        kept.append(batch)
        return len(batch.indices), batch.num_tokens

    def _forward(self, token_ids: list[Any], batch: Batch) -> dict[str, torch.Tensor]:
        input_ids_BT, attention_mask_BT = collate(token_ids, batch, self.spec.pad_token_id)
        # Flat indices of the real tokens, computed here so the GPU is never asked.
        valid_index_N = np.flatnonzero(attention_mask_BT.reshape(-1))
        return self.capture(
            _to_device(input_ids_BT, self.input_device),
            _to_device(attention_mask_BT, self.input_device),
            _to_device(valid_index_N, self.device),
        )

    def _pad_forward(self, rows: int, length: int, mask_last_token: bool = False) -> dict[str, torch.Tensor]:
        """A forward over a ``rows x length`` batch of pad tokens (the warm-up; a probe);
        ``mask_last_token``: the last row a token short (transformers drops an all-ones mask)."""
        ids_BT = np.full((rows, length), self.spec.pad_token_id, dtype=np.int64)
        mask_BT = np.ones_like(ids_BT)
        if mask_last_token:
            mask_BT[-1, -1] = 0
        return self.capture(
            _to_device(ids_BT, self.input_device),
            _to_device(mask_BT, self.input_device),
            _to_device(np.flatnonzero(mask_BT.reshape(-1)), self.device),
        )

    def _isolate(
        self, unit: WorkUnit, token_ids: list[Any], batch: Batch, sink: ShardSink
    ) -> tuple[list[Batch], list[tuple[int, str]]]:
        """A failed batch's samples rerun one at a time (isolation.rerun_alone)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed forward's blocks; an OOM'd batch may fit alone
        return rerun_alone(
            unit,
            token_ids,
            batch,
            forward=lambda single: self._forward(token_ids, single),
            submit=lambda position, features: sink.submit([unit.rows[position]], features),
            probe=lambda num_tokens: self._pad_forward(1, num_tokens),
            pad_to_multiple_of=self.spec.pad_to_multiple_of,
        )

    def close(self) -> None:
        self._compute_thread.shutdown(wait=True)
        if self.compiled is not None:
            self.compiled.wait()  # its thread calls into the layers: let it finish first
        self.capture.close()
        if self.compiled is not None:  # a model handed in goes back as it came
            self.compiled.restore()


@dataclass
class _ComputedUnit:
    """A unit whose forwards are done: its sink (still writing), what was kept and the timings."""

    sink: ShardSink
    kept: list[Batch]
    failures: list[tuple[int, str]]
    timeline: GpuTimeline
    previous_end: torch.cuda.Event | None
    compute_seconds: float
    started_at: float
    ended_at: float
    compiled: bool  # the compiled layers served this unit from its start


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
