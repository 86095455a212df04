"""A record the target raises on is isolated, not fatal.

When a batch's forward raises, its samples are rerun one at a time (:func:`rerun_alone`): the ones
that still raise are left out of the shard and come back in the unit result as ``worker_error``
rejections (:func:`rejected_sample`), and the rest of the unit is written as usual. Only failures
that are not about one record escape, as an :class:`ExtractionError` naming the unit: out of memory
or a CUDA error on a single sample, or a target that also fails a probe of pad tokens (broken, not
fed a bad record). The happy path pays nothing: no per-sample forward runs unless a batch failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pipelines.extract.batching import Batch, round_up
from pipelines.extract.errors import ExtractionError
from pipelines.extract.records import Rejection, RejectReason
from pipelines.extract.units import RejectedSample, WorkUnit

# Characters of an exception's text kept in a rejection message.
_ERROR_CHARS = 300

Features = dict[str, torch.Tensor]


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:_ERROR_CHARS]}"


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError | MemoryError)


def is_device_error(err: BaseException) -> bool:
    """Out of memory or a CUDA error: about the device, never about one record."""
    if is_out_of_memory(err):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        marker in text
        for marker in ("CUDA error", "device-side assert", "CUBLAS_STATUS_", "cuDNN error")
    )


def raise_if_device_broken(unit: WorkUnit, batch: Batch, err: Exception) -> None:
    """A CUDA error (a device-side assert, an illegal access) leaves the device unusable for
    this process: rerunning the batch's samples would only fail again, so say so now. (Out of
    memory is not one of these: the samples may fit one at a time.)"""
    if is_device_error(err) and not is_out_of_memory(err):
        raise ExtractionError(
            f"unit {unit.index} (shard {unit.shard_id}): a batch of {len(batch.indices)} "
            f"samples failed with a device error ({describe(err)}); the device is unusable "
            "after it, so the samples cannot be rerun one by one. A device-side assert in an "
            "embedding is often a token id past the target's vocabulary: check that the "
            "tokenizer belongs to the target"
        ) from err


def rerun_alone(
    unit: WorkUnit,
    token_ids: Sequence[Any],
    batch: Batch,
    *,
    forward: Callable[[Batch], Features],
    submit: Callable[[int, Features], None],
    probe: Callable[[int], object],
    pad_to_multiple_of: int,
) -> tuple[list[Batch], list[tuple[int, str]]]:
    """Rerun a failed batch's samples one at a time: the ones that work are submitted to the shard
    (``submit(position, features)``), the ones that raise come back as (position, error).

    ``forward(batch)`` runs the target over a batch of the unit; ``probe(num_tokens)`` over that
    many pad tokens. Raises ExtractionError when the failure is not a record's (the device's, or a
    target that fails the probe too)."""
    singles: list[Batch] = []
    failures: list[tuple[int, str]] = []
    for index in batch.indices:
        length = len(token_ids[index])
        single = Batch((index,), round_up(length, pad_to_multiple_of), length)
        try:
            features = forward(single)
        except Exception as err:
            if is_device_error(err):
                raise ExtractionError(
                    f"unit {unit.index} (shard {unit.shard_id}): {unit.origin(index)}: "
                    f"{describe(err)} on this sample alone ({length} tokens). Not a bad "
                    "record but the device's limit or state: lower batching.max_length (or "
                    "batching.token_budget), or use a larger device"
                ) from err
            failures.append((index, describe(err)))
            continue
        submit(index, features)
        singles.append(single)
    if failures and not singles:
        _raise_if_probe_fails(unit, len(batch.indices), failures[0], probe, max(1, pad_to_multiple_of))
    return singles, failures


def _raise_if_probe_fails(
    unit: WorkUnit,
    batch_size: int,
    first_failure: tuple[int, str],
    probe: Callable[[int], object],
    length: int,
) -> None:
    """Every sample of a batch failed alone: bad records, or a broken target? A forward over
    a few pad tokens tells. Raises ExtractionError when the target fails that too, so a
    broken model fails the job instead of rejecting every record."""
    try:
        probe(length)
    except Exception as err:
        index, error = first_failure
        raise ExtractionError(
            f"unit {unit.index} (shard {unit.shard_id}): all {batch_size} samples of a batch "
            f"failed alone (first: {unit.origin(index)}: {error}) and so did a {length}-token "
            f"probe of pad tokens ({describe(err)}): the target is broken, not the records"
        ) from err


def raise_if_every_sample_failed(
    unit: WorkUnit, kept: Sequence[Batch], failures: Sequence[tuple[int, str]]
) -> None:
    """A unit none of whose samples made it: a target/tokenizer mismatch, not bad records."""
    if failures and not kept:
        index, error = min(failures)
        raise ExtractionError(
            f"unit {unit.index} (shard {unit.shard_id}): the target raised on every "
            f"one of its {len(unit.rows)} samples (first: {unit.origin(index)}: "
            f"{error}). That is a target/tokenizer mismatch or a broken target, not "
            "bad records; nothing of the unit was written"
        )


def rejected_sample(unit: WorkUnit, position: int, error: str) -> RejectedSample:
    """The ``worker_error`` rejection of a sample left out of its unit."""
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
