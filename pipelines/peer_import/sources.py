"""Peers' per-sample dumps as hsstore samples: listing, reading, and checks against the lineage.

The layouts themselves (paths, keys, shapes) are :mod:`pipelines.export.peer_layouts`' (the writer
``hsstore export-features`` uses the same definitions). Neither layout records the target or the
layers, so the user states them (``--target``, ``--aux-layer-ids``) and every file is checked
against what they imply: the hidden size of the target, the number of aux layers, floating-point
features, token ids inside the vocabulary, one length for all of a sample's tensors. A file that
disagrees is refused with its path, never written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsstore.errors import HsstoreError
from pipelines.export.peer_layouts import (
    SPECULATORS_HIDDEN_DIR,
    read_speculators_sample,
    specforge_sample_from,
)

SOURCE_FORMATS = ("specforge", "speculators")
FINAL_STATE_CONVENTIONS = ("pre_norm", "post_norm")
_SPECFORGE_INDEX = re.compile(r"data_(\d+)\.ckpt$")
_SPECULATORS_INDEX = re.compile(r"hs_(\d+)\.safetensors$")


class ImportSourceError(HsstoreError, ValueError):
    """A peer's dump cannot be imported as stated (the message names the file and the mismatch)."""


@dataclass(frozen=True)
class SourceFile:
    """One sample file: its position in the import order and its path relative to the source."""

    index: int
    relative_path: str


@dataclass(frozen=True)
class Expectation:
    """What every sample must look like, from the user's lineage."""

    num_aux_layers: int
    hidden_size: int
    vocab_size: int


def list_source_files(source: Path, format: str) -> list[SourceFile]:  # noqa: A002
    """The sample files in import order: by the number in their name (``data_<i>``, ``hs_<i>``),
    which is the order ``hsstore export-features`` wrote them and speculators' dataset row order."""
    if format == "specforge":
        paths, pattern = sorted(source.rglob("*.ckpt")), _SPECFORGE_INDEX
    elif format == "speculators":
        paths, pattern = sorted((source / SPECULATORS_HIDDEN_DIR).glob("hs_*.safetensors")), _SPECULATORS_INDEX
    else:
        raise ImportSourceError(f"unknown source format {format!r}; choose one of {', '.join(SOURCE_FORMATS)}")
    numbered = []
    for path in paths:
        match = pattern.search(path.name)
        if match is None:
            raise ImportSourceError(f"{path}: not a {format} sample file name ({pattern.pattern})")
        numbered.append((int(match.group(1)), path.relative_to(source).as_posix()))
    numbered.sort()
    duplicates = sorted({i for (i, _), (j, _) in zip(numbered, numbered[1:], strict=False) if i == j})
    if duplicates:
        raise ImportSourceError(f"{source}: several {format} files have sample number {duplicates[0]}")
    if not numbered:
        raise ImportSourceError(f"{source}: no {format} sample files found")
    return [SourceFile(index, path) for index, path in numbered]


def _check_common(path: str, sample: dict[str, torch.Tensor], expect: Expectation) -> None:
    ids, mask = sample["input_ids"], sample["loss_mask"]
    aux, final = sample["aux_hidden_states"], sample["final_hidden_state"]
    num_tokens = int(ids.shape[0])
    if ids.dim() != 1 or mask.shape != ids.shape:
        raise ImportSourceError(f"{path}: input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} are not one [T]")
    if ids.is_floating_point() or (num_tokens and (int(ids.min()) < 0 or int(ids.max()) >= expect.vocab_size)):
        raise ImportSourceError(f"{path}: token ids outside the target's vocabulary [0, {expect.vocab_size})")
    want_aux = (num_tokens, expect.num_aux_layers, expect.hidden_size)
    if tuple(aux.shape) != want_aux:
        raise ImportSourceError(
            f"{path}: aux hidden states {tuple(aux.shape)}, expected {want_aux} "
            f"(T, the {expect.num_aux_layers} aux layers of --aux-layer-ids, the target's hidden size)"
        )
    if tuple(final.shape) != (num_tokens, expect.hidden_size):
        raise ImportSourceError(
            f"{path}: final hidden state {tuple(final.shape)}, expected {(num_tokens, expect.hidden_size)}"
        )
    for name, tensor in (("aux hidden states", aux), ("final hidden state", final)):
        if not tensor.is_floating_point():
            raise ImportSourceError(f"{path}: {name} are {tensor.dtype}, expected a floating-point dtype")


def read_specforge(source: Path, file: SourceFile, expect: Expectation) -> dict[str, torch.Tensor]:
    """A SpecForge file (its final state is post-norm, as the store keeps it)."""
    path = source / file.relative_path
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        aux = raw["aux_hidden_state"]
        if aux.shape[-1] != expect.num_aux_layers * expect.hidden_size:
            raise ImportSourceError(
                f"{path}: aux_hidden_state's last axis is {aux.shape[-1]}, expected "
                f"{expect.num_aux_layers} aux layers x hidden size {expect.hidden_size}"
            )
        sample = specforge_sample_from(raw, expect.num_aux_layers, path)
    except (KeyError, ValueError, RuntimeError, OSError) as err:
        if isinstance(err, ImportSourceError):
            raise
        raise ImportSourceError(f"{path}: not a readable SpecForge sample: {err}") from err
    _check_common(str(path), sample, expect)
    return sample


class SpeculatorsSource:
    """speculators' dump: the ``datasets`` folder (ids, loss mask) and ``hidden_states/hs_<i>``.

    ``final_state`` says what the last slot holds: ``pre_norm`` (what hs-connectors writes: the
    last layer's output before the final norm, which is applied here with the target's norm) or
    ``post_norm``."""

    def __init__(self, source: Path, final_state: str, target_dir: str) -> None:
        if final_state not in FINAL_STATE_CONVENTIONS:
            raise ImportSourceError(
                "--final-state is required for speculators dumps: pre_norm (hs-connectors' files) "
                "or post_norm"
            )
        try:
            from datasets import load_from_disk
        except ImportError as err:  # pragma: no cover - the extra installs it
            raise ImportSourceError("reading a speculators dump needs `datasets` (pip install 'hsstore[all]')") from err
        try:
            self.dataset = load_from_disk(str(source))
        except (FileNotFoundError, ValueError) as err:
            raise ImportSourceError(f"{source}: no Hugging Face datasets folder (input_ids, loss_mask): {err}") from err
        missing = [c for c in ("input_ids", "loss_mask") if c not in self.dataset.column_names]
        if missing:
            raise ImportSourceError(f"{source}: the dataset lacks columns {missing}")
        self.source = source
        self.final_state = final_state
        self.norm: tuple[torch.Tensor, float] | None = None
        if final_state == "pre_norm":
            from pipelines.train.target_heads import load_target_heads

            heads = load_target_heads(target_dir)
            self.norm = (heads.norm_weight_H.to(torch.float32), heads.norm_eps)

    def read(self, file: SourceFile, expect: Expectation) -> dict[str, torch.Tensor]:
        path = self.source / file.relative_path
        if file.index >= len(self.dataset):
            raise ImportSourceError(f"{path}: no dataset row {file.index} (the dataset has {len(self.dataset)})")
        try:
            raw = read_speculators_sample(path)
        except (KeyError, OSError, RuntimeError) as err:
            raise ImportSourceError(f"{path}: not a readable speculators sample: {err}") from err
        hidden = raw["hidden_states"]
        if hidden.dim() != 3 or hidden.shape[1] != expect.num_aux_layers + 1:
            raise ImportSourceError(
                f"{path}: hidden_states {tuple(hidden.shape)}, expected [T, {expect.num_aux_layers + 1}, H] "
                "(the aux layers of --aux-layer-ids, then the final state)"
            )
        row: dict[str, Any] = self.dataset[file.index]
        ids = torch.as_tensor(row["input_ids"], dtype=torch.int64).reshape(-1)
        if not torch.equal(ids, raw["token_ids"].to(torch.int64).reshape(-1)):
            raise ImportSourceError(f"{path}: token_ids differ from dataset row {file.index}'s input_ids")
        final = hidden[:, -1]
        if self.norm is not None:
            weight, eps = self.norm
            if weight.numel() != final.shape[-1]:
                raise ImportSourceError(f"{path}: hidden size {final.shape[-1]}, the target's final norm has {weight.numel()}")
            x = final.to(torch.float32)
            final = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        sample = {
            "input_ids": ids,
            "loss_mask": torch.as_tensor(row["loss_mask"], dtype=torch.int64).reshape(-1),
            "aux_hidden_states": hidden[:, :-1],
            "final_hidden_state": final,
        }
        _check_common(str(path), sample, expect)
        return sample
