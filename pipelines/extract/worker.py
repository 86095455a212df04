"""The extraction worker: owns the target model and turns work units into shards.

One worker per GPU (a Ray actor) or one in process (the local executor): the same class either
way, so a profile of the in-process run is a profile of what the actors do. A unit is written as
one shard with a deterministic id (``u000042`` for unit 42), so a retried or re-run unit can only
ever produce the same shard; the shard's files go to their own attempt folder and only the
driver's manifest commit makes them visible (hsstore's ShardWriter contract).

A record the target raises on is isolated, not fatal: when a batch's forward raises, its samples
are rerun one at a time, the ones that still raise are left out of the shard and come back in the
unit result as ``worker_error`` rejections (:class:`RejectedSample`), and the rest of the unit is
written as usual. Only failures that are not about one record escape, as :class:`ExtractionError`
naming the unit: out of memory or a CUDA error on a single sample, or a target that also fails a
one-token probe (broken, not fed a bad record). The happy path pays nothing: no per-sample forward
runs unless a batch failed.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from hsstore import FeatureSpec, ShardRecord, ShardWriter
from hsstore.errors import HsstoreError
from hsstore.format.codecs import encode_torch
from pipelines.extract.batching import Batch, collate, plan_batches, round_up
from pipelines.extract.capture import HiddenStateCapture, resolve_pass_attention_mask
from pipelines.extract.errors import ExtractionError
from pipelines.extract.placement import SplitPlacement, split_across_devices
from pipelines.extract.profiling import BATCH, SUBMIT, UNIT_FLUSH, UNIT_SETUP, FirstBatchesProfiler
from pipelines.extract.records import Rejection, RejectReason
from pipelines.extract.sink import HostBufferPool, SampleRow, ShardSink

logger = logging.getLogger(__name__)


def unit_shard_id(unit_index: int) -> str:
    """The shard a unit writes: deterministic, so retries and reruns recognise it."""
    return f"u{unit_index:06d}"


# Batches queued between the forwards and a shard's writer thread (bounds pinned host memory).
MAX_PENDING_BATCHES = 3
# Tokens of the warm-up batch written through a throwaway shard (ExtractionWorker._warm_write_path):
# enough to fill a few chunks of every array, so every code path of a write runs once.
WARM_WRITE_TOKENS = 1024

# Characters of an exception's text kept in a rejection message.
_ERROR_CHARS = 300


@dataclass(frozen=True)
class WorkUnit:
    """Consecutive accepted samples, written together as one shard."""

    index: int
    rows: tuple[SampleRow, ...]
    # Each row's record origin (``file:line``), for messages; empty: messages name the source id.
    origins: tuple[str, ...] = ()

    def origin(self, position: int) -> str:
        return self.origins[position] if self.origins else f"sample {self.rows[position].source_id}"

    @property
    def shard_id(self) -> str:
        return unit_shard_id(self.index)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.rows)


@dataclass(frozen=True)
class RejectedSample:
    """A sample of a unit that the target raised on when run alone; it is not in the shard."""

    position: int  # index into the unit's rows
    sample_id: str
    rejection: Rejection
    num_tokens: int = 0  # the sample's, so that counts can be corrected without the unit
    num_loss_tokens: int = 0


@dataclass(frozen=True)
class UnitResult:
    """What a worker returns for a unit: the record to commit and what it cost.

    Samples, tokens and batches count what the shard holds; ``rejected`` are the unit's samples
    left out (they travel back with the result, so a Ray actor's rejections reach the driver)."""

    unit_index: int
    record: ShardRecord
    num_samples: int
    num_tokens: int
    num_padded_tokens: int
    num_batches: int
    seconds: float  # the whole unit, shard finished
    compute_seconds: float  # holding the model (forwards; the GPU work may still be queued)
    write_seconds: float  # the writer thread's busy time (encode on CPU, checks, appends)
    rejected: tuple[RejectedSample, ...] = ()
    copy_wait_seconds: float = 0.0  # the writer thread waiting for device-to-host copies
    pool_wait_seconds: float = 0.0  # the forwards waiting for free host buffers (back-pressure)
    # Wall-clock (time.time()) span of the forwards, for the run's timeline: how long the model
    # waited for its first unit and how long the last shard took to finish after its forwards.
    compute_started_at: float = 0.0
    compute_ended_at: float = 0.0
    # When the unit's last batch was on the host (its forward and copy done on the GPU).
    landed_at: float = 0.0
    # On a GPU, from CUDA events around each forward: the device's time in the unit's forwards,
    # and its time between them (from the previous forward's end, the previous unit's included):
    # idle, or running what the extraction adds between forwards (the fp8 encode).
    gpu_forward_seconds: float = 0.0
    gpu_between_seconds: float = 0.0
    # Wall clock (time.time()) of the unit's first forward starting and its last one ending on
    # the GPU (from the events, against a clock set at the warm-up); 0.0 where not known.
    gpu_started_at: float = 0.0
    gpu_ended_at: float = 0.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable (it travels to Ray actors)."""

    target: str  # local model directory
    store: str
    features: tuple[FeatureSpec, ...]
    aux_layer_ids: tuple[int, ...]
    final_hidden_state: bool = True
    topk_k: int | None = None
    topk_chunk_tokens: int = 4096
    dtype: str = "bfloat16"
    device: str = "auto"
    attn_implementation: str | None = "sdpa"
    trust_remote_code: bool = False
    token_budget: int = 16384
    max_batch_size: int | None = None
    # The longest sample (batching.max_length): sets the shape of the start-up warm-up batch.
    max_length: int | None = None
    pad_to_multiple_of: int = 8
    pass_attention_mask: bool | str = "auto"  # see capture.resolve_pass_attention_mask
    pad_token_id: int = 0
    storage_options: dict[str, Any] = field(default_factory=dict)
    # GPUs this worker owns (a Ray actor with num_gpus_per_worker > 1): the target is split over
    # them (placement.py), for targets larger than one GPU.
    num_gpus: int = 1
    # profiler.dir / profiler.batches: a trace of the first unit's first batches (profiling.py).
    profile_dir: str | None = None
    profile_batches: int = 3


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target(
    target: str,
    *,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The target as an eval-mode ``AutoModelForCausalLM`` on ``device`` (weights loaded there)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    kwargs: dict[str, Any] = {
        "dtype": getattr(torch, dtype),
        "trust_remote_code": trust_remote_code,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # load straight onto the GPU, no host copy of 16 GB
    model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
    if device.type != "cuda":
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_split_target(spec: WorkerSpec) -> tuple[torch.nn.Module, SplitPlacement]:
    """The target loaded on the host, then its layers split over this worker's ``num_gpus`` GPUs
    (the first ``num_gpus`` visible ones: a Ray actor sees exactly its own)."""
    visible = torch.cuda.device_count()
    if visible < spec.num_gpus:
        raise ExtractionError(
            f"the worker should split the target over {spec.num_gpus} GPUs but sees {visible}"
        )
    model = load_target(
        spec.target,
        dtype=spec.dtype,
        device="cpu",
        attn_implementation=spec.attn_implementation,
        trust_remote_code=spec.trust_remote_code,
    )
    placement = split_across_devices(model, [f"cuda:{i}" for i in range(spec.num_gpus)])
    logger.info(
        "split the target over %d GPUs: layers on %s", spec.num_gpus, placement.layer_devices
    )
    return model, placement


class ExtractionWorker:
    """Loads the target once; :meth:`run_unit` writes one unit's shard and returns its record."""

    def __init__(self, spec: WorkerSpec, model: torch.nn.Module | None = None):
        """``model``: an already loaded target (benchmarks, tests); default: load ``spec.target``."""
        self.spec = spec
        self.device = resolve_device(spec.device)  # where features are gathered and copied from
        self.input_device = self.device  # where token ids go (the embeddings' device)
        if model is None and spec.num_gpus > 1:
            model, placement = load_split_target(spec)
            self.input_device, self.device = placement.input_device, placement.output_device
        self.model = (
            model
            if model is not None
            else load_target(
                spec.target,
                dtype=spec.dtype,
                device=self.device,
                attn_implementation=spec.attn_implementation,
                trust_remote_code=spec.trust_remote_code,
            )
        )
        # Every forward (the warm-up's included) runs on this one thread: _on_compute_thread.
        self._compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forwards")
        self._last_forward_end: torch.cuda.Event | None = None  # the previous unit's, on a GPU
        self._gpu_clock: _GpuClock | None = None  # set by the warm-up
        self.profiler = FirstBatchesProfiler(spec.profile_dir, spec.profile_batches, self.device)
        # Pinned host buffers for the device-to-host copies, shared by the units in flight: as
        # many as the sink's queue holds plus the one being written and the one being copied.
        self.host_buffers = HostBufferPool(
            spec.features,
            spec.token_budget,
            MAX_PENDING_BATCHES + 2,
            pin=self.device.type == "cuda",
        )
        if self.device.type == "cuda":
            self.host_buffers.preallocate()
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
        self.warmup_seconds = (
            self._on_compute_thread(self.warm_up) if self.device.type == "cuda" else 0.0
        )

    def warm_shape(self) -> tuple[int, int]:
        """``(rows, length)`` of the warm-up batch: the largest batch the plan can make, as many
        rows of the longest sample as the token budget holds (batching.plan_batches' limits)."""
        budget = self.spec.token_budget
        length = min(self.spec.max_length or budget, budget)
        length = round_up(length, self.spec.pad_to_multiple_of)
        rows = max(1, budget // length)
        if self.spec.max_batch_size:
            rows = min(rows, self.spec.max_batch_size)
        return rows, length

    def warm_up(self) -> float:
        """One batch of the largest shape through capture, GPU encode and copy, before any unit.

        Why: the first forwards of a process pay for CUDA loading its kernels, cuBLAS creating its
        handles and the caching allocator growing its pools; here that happens while the worker
        starts (as a serving engine warms up before it takes requests), not in the first unit. It
        is also the memory check: a token budget the device cannot hold fails now, naming the
        setting, instead of as an out-of-memory in the first unit. Returns its seconds.
        """
        rows, length = self.warm_shape()
        start = time.perf_counter()
        ids_BT = np.full((rows, length), self.spec.pad_token_id, dtype=np.int64)
        try:
            features = self.capture(
                _to_device(ids_BT, self.input_device),
                _to_device(np.ones_like(ids_BT), self.input_device),
                _to_device(np.arange(ids_BT.size), self.device),
            )
            buffers = self.host_buffers.acquire(ids_BT.size)
            try:
                for spec in self.spec.features:
                    for name, bits in encode_torch(spec, features[spec.name]).items():
                        buffers[name][: ids_BT.size].copy_(bits, non_blocking=True)
            finally:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the copies are over: the set is free
                self.host_buffers.release(buffers)
            self._warm_write_path(features)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self._gpu_clock = _GpuClock.start(self.device)
        except ExtractionError:
            raise
        except Exception as err:
            if _is_out_of_memory(err):
                raise ExtractionError(
                    f"the warm-up batch ({rows} x {length} tokens, batching.token_budget="
                    f"{self.spec.token_budget}) ran out of memory on {self.device}: lower "
                    "batching.token_budget (or batching.max_length), or use a larger device"
                ) from err
            raise ExtractionError(f"the target failed its warm-up batch: {_describe(err)}") from err
        seconds = time.perf_counter() - start
        logger.info("warmed up on a %d x %d batch in %.2f s", rows, length, seconds)
        return seconds

    def _warm_write_path(self, features: dict[str, torch.Tensor]) -> None:
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
            writer = ShardWriter(folder, unit_shard_id(0), list(self.spec.features))
            sink = ShardSink(writer, self.device, pool=self.host_buffers, max_pending_batches=1)
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
                f"unit {unit.index} (shard {unit.shard_id}) failed: {_describe(err)}"
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
            rejected=tuple(_rejected_sample(unit, i, error) for i, error in sorted(done.failures)),
        )

    def _on_compute_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the compute thread and wait for it (its exception is raised here).

        Why one thread: CUDA keeps per-thread state that a forward needs (PyTorch's cuBLAS handles
        and workspaces are per thread), so a forward on a fresh thread pays for setting it up again.
        Ray runs an actor's calls on threads of its own choosing and LocalExecutor on a new pool per
        run; on the one thread the warm-up ran on, the first unit's forwards find everything ready.
        """
        return self._compute_thread.submit(fn, *args).result()

    def _compute_unit(self, unit: WorkUnit, on_batch: Callable[[int, int], None] | None) -> _ComputedUnit:
        """The unit's forwards, on the compute thread: each batch's features go to the unit's sink."""
        compute_start = time.perf_counter()
        started_at = time.time()
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
                writer = ShardWriter(
                    self.spec.store,
                    unit.shard_id,
                    list(self.spec.features),
                    storage_options=self.spec.storage_options,
                )
                sink = ShardSink(
                    writer,
                    self.device,
                    pool=self.host_buffers,
                    max_pending_batches=MAX_PENDING_BATCHES,
                    copy_pieces=len(self.capture.pace_layers),
                )
            if self.device.type == "cuda":
                self.capture.on_pace = sink.pace  # this unit's copies ride its next forwards
            try:
                for batch in batches:
                    with record_function(BATCH):
                        num_samples, num_tokens = self._batch(unit, token_ids, batch, timeline, sink, kept, failures)
                    self.profiler.batch_done()
                    if on_batch is not None and num_samples:
                        on_batch(num_samples, num_tokens)
                if failures and not kept:
                    index, error = min(failures)
                    raise ExtractionError(
                        f"unit {unit.index} (shard {unit.shard_id}): the target raised on every "
                        f"one of its {len(unit.rows)} samples (first: {unit.origin(index)}: "
                        f"{error}). That is a target/tokenizer mismatch or a broken target, not "
                        "bad records; nothing of the unit was written"
                    )
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
            self._raise_if_device_broken(unit, batch, err)
            logger.warning(
                "unit %d: a batch of %d samples failed (%s); rerunning them alone",
                unit.index,
                len(batch.indices),
                _describe(err),
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

    def _isolate(
        self, unit: WorkUnit, token_ids: list[Any], batch: Batch, sink: ShardSink
    ) -> tuple[list[Batch], list[tuple[int, str]]]:
        """Rerun a failed batch's samples one at a time: the ones that work go to the shard, the
        ones that raise come back as (position, error). Raises ExtractionError when the failure
        is not a record's (the device's, or a target that fails a probe too)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed forward's blocks; an OOM'd batch may fit alone
        singles: list[Batch] = []
        failures: list[tuple[int, str]] = []
        for index in batch.indices:
            length = len(token_ids[index])
            single = Batch((index,), round_up(length, self.spec.pad_to_multiple_of), length)
            try:
                features = self._forward(token_ids, single)
            except Exception as err:
                if _is_device_error(err):
                    raise ExtractionError(
                        f"unit {unit.index} (shard {unit.shard_id}): {unit.origin(index)}: "
                        f"{_describe(err)} on this sample alone ({length} tokens). Not a bad "
                        "record but the device's limit or state: lower batching.max_length (or "
                        "batching.token_budget), or use a larger device"
                    ) from err
                failures.append((index, _describe(err)))
                continue
            sink.submit([unit.rows[index]], features)
            singles.append(single)
        if failures and not singles:
            self._probe(unit, len(batch.indices), failures[0])
        return singles, failures

    def _probe(self, unit: WorkUnit, batch_size: int, first_failure: tuple[int, str]) -> None:
        """Every sample of a batch failed alone: bad records, or a broken target? A forward over
        a few pad tokens tells. Raises ExtractionError when the target fails that too, so a
        broken model fails the job instead of rejecting every record."""
        length = max(1, self.spec.pad_to_multiple_of)
        ids_BT = np.full((1, length), self.spec.pad_token_id, dtype=np.int64)
        try:
            self.capture(
                _to_device(ids_BT, self.input_device),
                _to_device(np.ones_like(ids_BT), self.input_device),
                _to_device(np.arange(length), self.device),
            )
        except Exception as err:
            index, error = first_failure
            raise ExtractionError(
                f"unit {unit.index} (shard {unit.shard_id}): all {batch_size} samples of a batch "
                f"failed alone (first: {unit.origin(index)}: {error}) and so did a {length}-token "
                f"probe of pad tokens ({_describe(err)}): the target is broken, not the records"
            ) from err

    def _raise_if_device_broken(self, unit: WorkUnit, batch: Batch, err: Exception) -> None:
        """A CUDA error (a device-side assert, an illegal access) leaves the device unusable for
        this process: rerunning the batch's samples would only fail again, so say so now. (Out of
        memory is not one of these: the samples may fit one at a time.)"""
        if _is_device_error(err) and not _is_out_of_memory(err):
            raise ExtractionError(
                f"unit {unit.index} (shard {unit.shard_id}): a batch of {len(batch.indices)} "
                f"samples failed with a device error ({_describe(err)}); the device is unusable "
                "after it, so the samples cannot be rerun one by one. A device-side assert in an "
                "embedding is often a token id past the target's vocabulary: check that the "
                "tokenizer belongs to the target"
            ) from err

    def close(self) -> None:
        self._compute_thread.shutdown(wait=True)
        self.capture.close()


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


@dataclass(frozen=True)
class _GpuClock:
    """An event the GPU ran at a known wall-clock time: later events' times follow from it."""

    event: torch.cuda.Event
    at: float

    @classmethod
    def start(cls, device: torch.device) -> _GpuClock:
        """On an idle device (just synchronised): the event runs as soon as it is recorded."""
        event = torch.cuda.Event(enable_timing=True)
        before = time.time()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
        return cls(event, (before + time.time()) / 2)

    def wall(self, event: torch.cuda.Event) -> float:
        return self.at + self.event.elapsed_time(event) / 1e3


class GpuTimeline:
    """CUDA events around a unit's forwards (nothing on a CPU): how long the GPU spent in them and
    between them (benchmarks time their bare forwards with it too). The host queues work ~0.5 s ahead of the GPU, so host timers cannot tell a slow
    forward from an idle GPU; events on the compute stream can. Read only once the unit's copies
    are done (its events are then complete), so reading never stalls the forwards."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.enabled = device is not None and device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.device)  # the forward's (the model's device)
        start.record(stream)
        yield
        end.record(stream)
        self.events.append((start, end))

    @property
    def last_end(self) -> torch.cuda.Event | None:
        return self.events[-1][1] if self.events else None

    def seconds(self, previous_end: torch.cuda.Event | None) -> tuple[float, float]:
        """(in the forwards, between them): the gap before the first counts from ``previous_end``,
        the previous unit's last forward (none for a worker's first unit)."""
        forward_ms = between_ms = 0.0
        if self.events:
            self.events[-1][1].synchronize()  # done already (the copies were); cheap insurance
        for start, end in self.events:
            if previous_end is not None:
                between_ms += previous_end.elapsed_time(start)
            forward_ms += start.elapsed_time(end)
            previous_end = end
        return forward_ms / 1e3, between_ms / 1e3

    def wall_span(self, clock: _GpuClock | None) -> tuple[float, float]:
        """Wall clock of the first forward's start and the last one's end on the GPU."""
        if clock is None or not self.events:
            return 0.0, 0.0
        return clock.wall(self.events[0][0]), clock.wall(self.events[-1][1])


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _rejected_sample(unit: WorkUnit, position: int, error: str) -> RejectedSample:
    row = unit.rows[position]
    message = (
        f"{unit.origin(position)}: the target raised on this record ({error}); left out of unit "
        f"{unit.index} (shard {unit.shard_id}), the rest of the unit was kept"
    )
    origin = unit.origins[position] if unit.origins else row.source_id
    rejection = Rejection(RejectReason.WORKER_ERROR, message, origin, row.source_id, "")
    return RejectedSample(
        position, row.sample_id, rejection, len(row.input_ids), int(np.asarray(row.loss_mask).sum())
    )


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:_ERROR_CHARS]}"


def _is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError | MemoryError)


def _is_device_error(err: BaseException) -> bool:
    """Out of memory or a CUDA error: about the device, never about one record."""
    if _is_out_of_memory(err):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        marker in text
        for marker in ("CUDA error", "device-side assert", "CUBLAS_STATUS_", "cuDNN error")
    )
