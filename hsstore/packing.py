"""The streaming loader's plan: epoch order, packing and partitioning, as pure functions of lengths.

Everything here is numpy over per-sample lengths; no store, no torch, no I/O. That keeps the plan a
pure function of ``(seed, epoch, shard list, sample lengths, settings)``, which is what makes an
interrupted run resumable from a handful of scalars and every rank agree without talking.

The epoch, step by step:

1. **Shard order**: the manifest's shards are permuted (per seed and epoch).
2. **Sample order**: the shards' samples are laid end to end (row order inside a shard), then each
   sample is displaced by a random offset of at most half a ``shuffle_window`` and the sequence is
   re-sorted by displaced position (MosaicML's py1e idea): a sample moves at most one window, so
   reads stay local to a few shards while neighbours are thoroughly mixed.
3. **Packing**: consecutive blocks of ``shuffle_window`` samples are packed best-fit-decreasing into
   rows of ``token_budget`` tokens (a row never splits a sample). Rows are then ordered by the
   shuffled position of their first sample, so steps do not go from long to short samples.
4. **Batches and partition**: ``rows_per_batch`` consecutive rows form a batch. The batch count is
   made a multiple of ``world_size`` (``remainder="drop"`` drops the tail rows; ``"wrap"`` repeats
   rows from the epoch's start), so every rank runs the same number of steps. Rank r takes the
   contiguous block of batches ``[r * n, (r + 1) * n)`` (contiguous, not strided, so that a rank's
   reads stay within the same few shards).

Random numbers come from a splitmix64 hash of ``(seed, epoch, stream, index)`` rather than numpy's
generators, whose streams numpy does not promise to keep across versions: an order computed on one
machine is the order on every machine.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hsstore.errors import HsstoreError

Remainder = Literal["drop", "wrap"]
LongSamples = Literal["error", "truncate"]

_STREAM_SHARDS = 1
_STREAM_SAMPLES = 2
_STREAM_ROWS = 3


class LoaderError(HsstoreError, ValueError):
    """The store cannot be streamed as asked (too small for the world size, a sample too long...)."""


def hash_uniform(seed: int, epoch: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from a splitmix64 hash: deterministic on every platform and version."""
    mask = np.uint64(0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        key = (
            np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
            + np.uint64(epoch & 0xFFFFFFFF) * np.uint64(0xBF58476D1CE4E5B9)
            + np.uint64(stream) * np.uint64(0x94D049BB133111EB)
        ) & mask
        z = index.astype(np.uint64) + key
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(num_shards)`` for this epoch."""
    keys = hash_uniform(seed, epoch, _STREAM_SHARDS, np.arange(num_shards))
    return np.argsort(keys, kind="stable")


def epoch_sample_order(
    shard_sample_counts: Sequence[int], seed: int, epoch: int, shuffle_window: int
) -> np.ndarray:
    """Global sample indices (manifest order: shard by shard, row by row) in this epoch's order."""
    counts = np.asarray(shard_sample_counts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else np.zeros(0, np.int64)
    pieces = [np.arange(starts[s], starts[s] + counts[s]) for s in shard_order(len(counts), seed, epoch)]
    laid_out = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    if shuffle_window <= 1 or len(laid_out) <= 1:
        return laid_out
    jitter = hash_uniform(seed, epoch, _STREAM_SAMPLES, laid_out)
    displaced = np.arange(len(laid_out)) + (jitter - 0.5) * shuffle_window
    return laid_out[np.argsort(displaced, kind="stable")]


def pack_rows(
    order: np.ndarray, lengths: np.ndarray, token_budget: int, block_size: int
) -> list[np.ndarray]:
    """Best-fit-decreasing packing of ``order`` (sample indices) into rows of ``token_budget`` tokens.

    ``lengths[i]`` is sample i's length, already clipped to the budget. Rows never cross a block of
    ``block_size`` consecutive samples, which bounds how far packing moves a sample. Returns one array
    of sample indices per row, rows ordered by the position of their first sample in ``order``.
    """
    rows: list[tuple[int, list[int]]] = []
    for block_start in range(0, len(order), block_size):
        block = order[block_start : block_start + block_size]
        block_lengths = lengths[block]
        # Longest first; ties keep shuffled order (stable), so the result is deterministic.
        by_length = np.argsort(-block_lengths, kind="stable")
        free: list[tuple[int, int]] = []  # (free tokens, row id), kept sorted
        block_rows: list[list[int]] = []
        for position in by_length:
            need = int(block_lengths[position])
            slot = bisect.bisect_left(free, (need, -1))
            if slot == len(free):
                row_id = len(block_rows)
                block_rows.append([int(position)])
                remaining = token_budget - need
            else:
                remaining, row_id = free.pop(slot)
                block_rows[row_id].append(int(position))
                remaining -= need
            if remaining > 0:
                bisect.insort(free, (remaining, row_id))
        for members in block_rows:
            rows.append((block_start + min(members), [int(block[m]) for m in members]))
    rows.sort(key=lambda item: item[0])
    return [np.asarray(members, dtype=np.int64) for _, members in rows]


@dataclass(frozen=True)
class EpochPlan:
    """One epoch of one rank: which samples go into which row of which batch.

    ``batches[j]`` is a list of ``rows_per_batch`` rows, each an array of global sample indices in
    the order they are laid out in the row.
    """

    epoch: int
    batches: list[list[np.ndarray]]
    num_rows_total: int  # rows in the whole epoch before drop/wrap, all ranks
    num_rows_dropped: int
    num_rows_repeated: int
    num_samples_truncated: int
    padding_fraction: float  # padding tokens / row tokens, whole epoch (all ranks)

    @property
    def num_batches(self) -> int:
        return len(self.batches)


def plan_epoch(
    shard_sample_counts: Sequence[int],
    lengths: np.ndarray,
    *,
    seed: int,
    epoch: int,
    token_budget: int,
    rows_per_batch: int,
    shuffle_window: int,
    rank: int = 0,
    world_size: int = 1,
    remainder: Remainder = "drop",
    long_samples: LongSamples = "error",
    sample_names: Sequence[str] | None = None,
) -> EpochPlan:
    """The plan of ``rank`` for ``epoch``: a pure function of the arguments (see the module doc)."""
    if not 0 <= rank < world_size:
        raise LoaderError(f"rank {rank} is outside world_size {world_size}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if int(np.sum(shard_sample_counts)) != len(lengths):
        raise LoaderError(
            f"shard sample counts sum to {int(np.sum(shard_sample_counts))} but {len(lengths)} lengths were given"
        )
    too_long = np.flatnonzero(lengths > token_budget)
    if len(too_long) and long_samples == "error":
        first = int(too_long[0])
        name = sample_names[first] if sample_names is not None else f"#{first}"
        raise LoaderError(
            f"{len(too_long)} sample(s) are longer than loader.token_budget={token_budget} "
            f"(first: sample {name} with {int(lengths[first])} tokens); raise the budget or set "
            "loader.long_samples=truncate"
        )
    clipped = np.minimum(lengths, token_budget)
    order = epoch_sample_order(shard_sample_counts, seed, epoch, shuffle_window)
    order = order[clipped[order] > 0]  # an empty sample has nothing to train on
    rows = pack_rows(order, clipped, token_budget, block_size=max(shuffle_window, 1))
    num_rows = len(rows)
    used = int(clipped[order].sum())
    padding = 1.0 - used / (num_rows * token_budget) if num_rows else 0.0

    unit = rows_per_batch * world_size
    dropped = repeated = 0
    if remainder == "drop":
        keep = (num_rows // unit) * unit
        dropped = num_rows - keep
        rows = rows[:keep]
    else:
        target = -(-num_rows // unit) * unit
        repeated = target - num_rows
        rows = rows + [rows[i % max(num_rows, 1)] for i in range(repeated)] if num_rows else rows
    if not rows:
        raise LoaderError(
            f"the store packs into {num_rows} row(s) of {token_budget} tokens, fewer than one batch per "
            f"rank ({rows_per_batch} row(s) x {world_size} rank(s)); lower loader.token_budget or "
            "loader.rows_per_batch, or use loader.remainder=wrap"
        )
    per_rank = len(rows) // unit
    first = rank * per_rank * rows_per_batch
    mine = rows[first : first + per_rank * rows_per_batch]
    batches = [mine[j * rows_per_batch : (j + 1) * rows_per_batch] for j in range(per_rank)]
    return EpochPlan(
        epoch=epoch,
        batches=batches,
        num_rows_total=num_rows,
        num_rows_dropped=dropped,
        num_rows_repeated=repeated,
        num_samples_truncated=int(len(too_long)),
        padding_fraction=padding,
    )


@dataclass(frozen=True)
class RowLayout:
    """Per-token packing metadata of a batch, ``[B, T]`` numpy arrays (see :func:`layout_rows`)."""

    position_ids: np.ndarray  # int64, restarts at 0 for every document; 0 on padding
    doc_ids: np.ndarray  # int32, document index within its row; -1 on padding
    doc_remaining: np.ndarray  # int32, tokens after this one in its document; 0 on padding
    doc_lengths: list[list[int]]  # per row, the (clipped) document lengths in row order
    num_real_tokens: int


def layout_rows(row_lengths: Sequence[Sequence[int]], token_budget: int) -> RowLayout:
    """Position ids, document ids and ``doc_remaining`` for rows of documents of the given lengths.

    ``doc_remaining[b, t]`` is how many tokens of the same document follow position t: the TTT unroll
    at depth i may only use position t where the tokens it predicts (t+1+i and on) exist in the
    same document, i.e. where ``doc_remaining`` is large enough; attention uses ``doc_ids``.
    """
    num_rows = len(row_lengths)
    position_ids = np.zeros((num_rows, token_budget), dtype=np.int64)
    doc_ids = np.full((num_rows, token_budget), -1, dtype=np.int32)
    doc_remaining = np.zeros((num_rows, token_budget), dtype=np.int32)
    total = 0
    for b, lengths in enumerate(row_lengths):
        cursor = 0
        for d, length in enumerate(lengths):
            stop = cursor + length
            if stop > token_budget:
                raise LoaderError(f"row {b} holds {stop} tokens, over the budget of {token_budget}")
            span = np.arange(length)
            position_ids[b, cursor:stop] = span
            doc_ids[b, cursor:stop] = d
            doc_remaining[b, cursor:stop] = length - 1 - span
            cursor = stop
        total += cursor
    return RowLayout(
        position_ids=position_ids,
        doc_ids=doc_ids,
        doc_remaining=doc_remaining,
        doc_lengths=[list(map(int, lengths)) for lengths in row_lengths],
        num_real_tokens=total,
    )
