"""Length-bucketed batches under a token budget, and the padding they cost.

A work unit's samples are sorted by length (longest first, so that an out-of-memory batch shows
up at the start of a run rather than hours in) and cut greedily into batches whose *padded* size,
``batch_size * longest``, stays within ``token_budget``. Neighbours in that order have similar
lengths, so right padding wastes little; the waste is measured and reported, not assumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    """Indices into a unit's sample list, and the padded length they share."""

    indices: tuple[int, ...]
    padded_length: int
    num_tokens: int  # real (unpadded) tokens

    @property
    def num_padded_tokens(self) -> int:
        return self.padded_length * len(self.indices)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_batches(
    lengths: Sequence[int],
    token_budget: int,
    *,
    max_batch_size: int | None = None,
    pad_to_multiple_of: int = 1,
) -> list[Batch]:
    """Group sample indices into batches of similar length whose padded size fits ``token_budget``.

    Deterministic (ties broken by index). A sample longer than the budget gets a batch of its own
    rather than an error: the recipe validates ``token_budget >= max_length``, so this only
    happens when a caller asks for it.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[Batch] = []
    current: list[int] = []
    padded_length = 0
    for index in order:
        length = lengths[index]
        if length < 1:
            raise ValueError(f"sample {index} has length {length}; every sample needs a token")
        if current:
            fits = (len(current) + 1) * padded_length <= token_budget
            room = max_batch_size is None or len(current) < max_batch_size
            if fits and room:
                current.append(index)
                continue
            batches.append(Batch(tuple(current), padded_length, sum(lengths[i] for i in current)))
        current = [index]
        padded_length = round_up(length, pad_to_multiple_of)
    if current:
        batches.append(Batch(tuple(current), padded_length, sum(lengths[i] for i in current)))
    return batches


def padding_waste(batches: Sequence[Batch]) -> float:
    """Fraction of the computed tokens that are padding (0.0 = none)."""
    padded = sum(b.num_padded_tokens for b in batches)
    return 0.0 if padded == 0 else 1.0 - sum(b.num_tokens for b in batches) / padded


def collate(
    token_ids: Sequence[np.ndarray], batch: Batch, pad_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``input_ids_BT`` (int64) and ``attention_mask_BT`` (int64, 1 = real token).

    Right padding keeps every real token at positions ``0..len-1``, so rotary positions are the
    same as in an unbatched forward and the valid tokens of a row are a prefix of it.
    """
    input_ids_BT = np.full((len(batch.indices), batch.padded_length), pad_token_id, dtype=np.int64)
    attention_mask_BT = np.zeros_like(input_ids_BT)
    for row, index in enumerate(batch.indices):
        ids = token_ids[index]
        input_ids_BT[row, : len(ids)] = ids
        attention_mask_BT[row, : len(ids)] = 1
    return input_ids_BT, attention_mask_BT
