"""Work units: what the planner cuts and a worker writes as one shard, and what comes back.

Torch-free on purpose: the planner (and ``hsstore extract --dry-run``) builds units without ever
loading model code; only the worker, which runs the target, imports torch.

A unit is written as one shard with a deterministic id (``u000042`` for unit 42,
:func:`unit_shard_id`), so a retried or re-run unit can only ever produce the same shard, and a
resume recognises committed units by id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hsstore import ShardRecord
from pipelines.extract.recipe import UnitsSection
from pipelines.extract.records import Rejection


def unit_shard_id(unit_index: int) -> str:
    """The shard a unit writes: deterministic, so retries and reruns recognise it."""
    return f"u{unit_index:06d}"


@dataclass(frozen=True)
class SampleRow:
    """What the store's sample table needs of one sample besides its features."""

    sample_id: str
    source_id: str
    input_ids: Any  # np.int32 [T]
    loss_mask: Any  # np.uint8 [T]


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
    # model.compile: whether the compiled layers served the unit from its start (they compile in
    # the background while the first units run eager), and the worker's graphs so far.
    compiled: bool = False
    compiled_graphs: int = 0
    compile_seconds: float = 0.0  # the background compile's, once done (0.0 until then)


@dataclass(frozen=True)
class WorkerStartup:
    """What a worker's start cost, reported once it is ready (the run summary's start-up line)."""

    load_seconds: float  # loading the target (0.0: a model handed in)
    warmup_seconds: float  # the (eager) warm-up batch; the compile follows in the background
    compiled: bool  # model.compile resolved (the layers compile in the background)
    ready_at: float = 0.0  # wall clock (time.time()) when the worker was ready for units
    # Wall clock when the worker's constructor began (a Ray actor: its process up, its modules
    # imported), and the seconds it spent allocating (pinning) its host buffers.
    entered_at: float = 0.0
    buffers_seconds: float = 0.0


# -- cutting samples into units ------------------------------------------------------------------
#
# Samples are gathered into windows of about ``units.sort_window_tokens`` accepted tokens; each
# window is sorted longest first (ties in input order) and cut into units. A unit then holds samples
# of similar lengths, and so do its batches, whose padding is what the longest row costs the
# others. Windows keep memory bounded and the plan deterministic (a rerun cuts the same units).


class PlannedSample(Protocol):
    """What cutting needs of a sample (``tokenize.TokenizedSample`` is one)."""

    @property
    def sample_id(self) -> str: ...
    @property
    def source_id(self) -> str: ...
    @property
    def input_ids(self) -> np.ndarray: ...
    @property
    def loss_mask(self) -> np.ndarray: ...
    @property
    def num_tokens(self) -> int: ...


def window_is_full(num_tokens: int, settings: UnitsSection) -> bool:
    """Whether a window of ``num_tokens`` accepted tokens is closed and cut (never without
    ``sort_window_tokens``: the units then follow the input order in one window)."""
    return bool(settings.sort_window_tokens) and num_tokens >= settings.sort_window_tokens


def cut_window(
    samples: Sequence[PlannedSample],
    settings: UnitsSection,
    first_index: int,
    origins: Sequence[str] = (),
) -> list[WorkUnit]:
    """A closed window's units: its samples sorted longest first (with ``sort_window_tokens``),
    then cut into consecutive units (:func:`cut_units`). ``origins`` go with the samples."""
    if settings.sort_window_tokens:
        order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)  # stable
        samples = [samples[i] for i in order]
        origins = [origins[i] for i in order] if origins else ()
    return cut_units(samples, settings.max_tokens, settings.max_samples, first_index, origins)


def cut_into_units(samples: Sequence[PlannedSample], settings: UnitsSection) -> list[WorkUnit]:
    """The streaming planner's rule (planner.py) over samples already in memory (benchmarks and
    tests that make samples without records): consecutive windows closed by
    :func:`window_is_full`, each cut by :func:`cut_window`, units numbered from 0."""
    units: list[WorkUnit] = []
    window: list[PlannedSample] = []
    num_tokens = 0
    for sample in samples:
        window.append(sample)
        num_tokens += sample.num_tokens
        if window_is_full(num_tokens, settings):
            units.extend(cut_window(window, settings, len(units)))
            window, num_tokens = [], 0
    if window:
        units.extend(cut_window(window, settings, len(units)))
    return units


def cut_units(
    samples: Sequence[PlannedSample],
    max_tokens: int,
    max_samples: int,
    first_index: int,
    origins: Sequence[str] = (),
) -> list[WorkUnit]:
    """Consecutive units of at most ``max_tokens`` / ``max_samples``, numbered from ``first_index``,
    in the order given.

    ``origins``: each sample's record origin, in the order of ``samples`` (for messages)."""
    units: list[WorkUnit] = []
    rows: list[SampleRow] = []
    unit_origins: list[str] = []
    tokens = 0

    def close() -> None:
        units.append(WorkUnit(first_index + len(units), tuple(rows), tuple(unit_origins)))

    for position, sample in enumerate(samples):
        if rows and (tokens + sample.num_tokens > max_tokens or len(rows) >= max_samples):
            close()
            rows, unit_origins, tokens = [], [], 0
        rows.append(
            SampleRow(sample.sample_id, sample.source_id, sample.input_ids, sample.loss_mask)
        )
        if origins:
            unit_origins.append(origins[position])
        tokens += sample.num_tokens
    if rows:
        close()
    return units
