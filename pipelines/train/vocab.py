"""Draft vocabulary calibration: which target ids the draft's lm_head covers.

docs/design.md: the draft vocabulary is the ``draft_vocab_size`` most frequent target ids among
loss-masked tokens (ties broken by the lower id, so calibration is deterministic), sorted by id.
``d2t[i]`` is the int64 offset with ``target_id = i + d2t[i]`` and ``t2d`` a bool mask over the
target vocabulary, exactly the two tensors vLLM and SGLang load. The full vocabulary is the
identity (``d2t`` all zero, ``t2d`` all true).

A trimmed-vocabulary JSON (``vocab_file`` in the recipe) is either a bare JSON list of target ids
or this module's own file: ``{"format_version": 1, "vocab_size": V, "draft_vocab_size": N,
"target_ids": [...]}``, which :func:`write_vocab_file` writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hsstore.errors import RecipeError

if TYPE_CHECKING:
    import pyarrow as pa

VOCAB_FILE_VERSION = 1


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor  # int64 [V_draft], strictly increasing target ids
    vocab_size: int  # the target's vocabulary size

    @property
    def draft_vocab_size(self) -> int:
        return int(self.target_ids.shape[0])

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.draft_vocab_size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    @classmethod
    def from_target_ids(
        cls, target_ids: Iterable[int], vocab_size: int, source: str = ""
    ) -> DraftVocab:
        ids = torch.as_tensor(list(target_ids), dtype=torch.int64)
        where = f"{source}: " if source else ""
        if ids.numel() == 0:
            raise RecipeError(f"{where}the draft vocabulary is empty")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise RecipeError(
                f"{where}target ids must lie in [0, {vocab_size}); found {int(ids.min())}..{int(ids.max())}"
            )
        unique = torch.unique(ids)  # sorted
        if unique.numel() != ids.numel():
            raise RecipeError(
                f"{where}the draft vocabulary repeats {ids.numel() - unique.numel()} id(s)"
            )
        return cls(unique, vocab_size)

    @classmethod
    def full(cls, vocab_size: int) -> DraftVocab:
        return cls(torch.arange(vocab_size, dtype=torch.int64), vocab_size)


def calibrate_vocab(counts: np.ndarray | torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent ids of ``counts`` (one count per target id)."""
    counts_np = np.asarray(counts, dtype=np.int64)
    vocab_size = counts_np.shape[0]
    if not 0 < draft_vocab_size <= vocab_size:
        raise RecipeError(
            f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab_size}] (the target vocabulary)"
        )
    # Stable sort on -count keeps ascending ids among equal counts.
    order = np.argsort(-counts_np, kind="stable")[:draft_vocab_size]
    return DraftVocab(torch.as_tensor(np.sort(order), dtype=torch.int64), vocab_size)


def count_loss_tokens(
    input_ids: Iterable[np.ndarray], loss_masks: Iterable[np.ndarray], vocab_size: int
) -> np.ndarray:
    """Per-id counts of the tokens whose loss mask is set (int64 [vocab_size])."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in zip(input_ids, loss_masks, strict=True):
        ids = np.asarray(ids, dtype=np.int64)
        kept = ids[np.asarray(mask).astype(bool)]
        if kept.size and (kept.min() < 0 or kept.max() >= vocab_size):
            raise ValueError(
                f"token id {int(kept.max())} outside the target vocabulary of {vocab_size}"
            )
        counts += np.bincount(kept, minlength=vocab_size)
    return counts


def count_loss_tokens_in_table(samples: pa.Table, vocab_size: int) -> np.ndarray:
    """Counts from a store's sample table (``store.samples``: list columns ``input_ids`` and
    ``loss_mask``), flattened a record batch at a time without Python loops over tokens."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in samples.select(["input_ids", "loss_mask"]).to_batches():
        ids = batch.column(0).flatten().to_numpy(zero_copy_only=False)
        mask = batch.column(1).flatten().to_numpy(zero_copy_only=False)
        counts += count_loss_tokens([ids], [mask], vocab_size)
    return counts


def write_vocab_file(vocab: DraftVocab, path: str | os.PathLike[str]) -> Path:
    """Write the trimmed-vocabulary JSON atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": VOCAB_FILE_VERSION,
        "vocab_size": vocab.vocab_size,
        "draft_vocab_size": vocab.draft_vocab_size,
        "target_ids": vocab.target_ids.tolist(),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload) + "\n")
    os.replace(tmp, path)
    return path


def read_vocab_file(path: str | os.PathLike[str], vocab_size: int) -> DraftVocab:
    """Read a trimmed-vocabulary JSON (ours, or a bare list of target ids) for a target of
    ``vocab_size`` ids."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecipeError(f"vocab file {path}: cannot read it as JSON: {err}") from err
    if isinstance(data, dict):
        version = data.get("format_version")
        if version != VOCAB_FILE_VERSION:
            raise RecipeError(
                f"vocab file {path}: format_version {version!r} is not {VOCAB_FILE_VERSION}"
            )
        if data.get("vocab_size") != vocab_size:
            raise RecipeError(
                f"vocab file {path}: made for a target vocabulary of {data.get('vocab_size')} ids, "
                f"this target has {vocab_size}"
            )
        data = data.get("target_ids")
    if not isinstance(data, list) or not all(type(i) is int for i in data):
        raise RecipeError(f"vocab file {path}: expected a list of integer target ids")
    return DraftVocab.from_target_ids(data, vocab_size, source=f"vocab file {path}")
