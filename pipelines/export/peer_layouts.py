"""Peers' offline feature layouts: where each sample's file goes and which tensors it holds.

Two layouts in use today, both one file per sample and neither recording the target or the layers:

- **SpecForge** (sgl-project's offline EAGLE-3 trainer, 0.2.0): ``rows_<g>-<g+5000>/data_<i>.ckpt``,
  a ``torch.save`` dict of ``input_ids`` and ``loss_mask`` (``[T]`` int64), ``hidden_state``
  (``[1, T, H]``, the target's final state *after* its final norm) and ``aux_hidden_state``
  (``[1, T, K*H]`` bf16, the aux layers concatenated along the last axis in layer order). Its
  reader lists every ``*.ckpt`` under the directory and sorts the paths as strings; its layer ids
  are SGLang's (the Hugging Face ``hidden_states`` index minus one).
- **speculators** (vLLM's, 0.9.0; the hs-connectors files its ``generate_offline_data`` writes):
  a Hugging Face ``datasets`` folder (``save_to_disk``: ``input_ids``, ``loss_mask``, ``seq_len``,
  torch format) and beside it ``hidden_states/hs_<i>.safetensors`` with ``hidden_states``
  (``[T, K+1, H]``: the K aux layers, then the final state *before* the final norm: its trainer
  applies the verifier's norm itself) and ``token_ids`` (``[T]`` int64). Row ``i`` of the dataset
  goes with ``hs_<i>``.

This module only knows the layouts (paths, keys, shapes); :mod:`pipelines.export.features` streams a
store into them. Reading back is here too, so that a round trip can be checked and an importer can
share the definitions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

SPECFORGE_ROWS_PER_DIR = 5000
SPECFORGE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
SPECULATORS_HIDDEN_DIR = "hidden_states"
SPECULATORS_COLUMNS = ("input_ids", "loss_mask", "seq_len")


def specforge_sample_path(index: int) -> str:
    """Relative path of sample ``index``: ``rows_0-5000/data_0.ckpt``, ``rows_5000-10000/...``."""
    group = (index // SPECFORGE_ROWS_PER_DIR) * SPECFORGE_ROWS_PER_DIR
    return f"rows_{group}-{group + SPECFORGE_ROWS_PER_DIR}/data_{index}.ckpt"


def speculators_sample_path(index: int) -> str:
    """Relative path of the hidden states of dataset row ``index``."""
    return f"{SPECULATORS_HIDDEN_DIR}/hs_{index}.safetensors"


def _atomic_write(path: Path, write: Any) -> int:
    """``write(tmp_path)`` then rename: a crash never leaves a half-written file at the real name
    (SpecForge's and speculators' readers take any file with the right name as complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)
    return path.stat().st_size


def write_specforge_sample(
    path: Path,
    input_ids_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    aux_TKH: torch.Tensor,
    final_TH: torch.Tensor,
) -> int:
    """Write one SpecForge sample file; returns its size in bytes.

    Tensors are cloned into storages of their own: ``torch.save`` writes a view's whole underlying
    storage, so a slice of a block read would otherwise carry its neighbours' bytes.
    """
    num_tokens, num_layers, hidden = aux_TKH.shape
    payload = {
        "input_ids": input_ids_T.to(torch.int64).clone(),
        "loss_mask": loss_mask_T.to(torch.int64).clone(),
        "hidden_state": final_TH.reshape(1, num_tokens, hidden).clone(),
        "aux_hidden_state": aux_TKH.reshape(1, num_tokens, num_layers * hidden).clone(),
    }
    return _atomic_write(path, lambda tmp: torch.save(payload, tmp))


def read_specforge_sample(path: str | Path, num_aux_layers: int) -> dict[str, torch.Tensor]:
    """One SpecForge sample as hsstore's shapes: ``input_ids``/``loss_mask`` ``[T]``,
    ``aux_hidden_states`` ``[T, K, H]``, ``final_hidden_state`` ``[T, H]``.

    ``weights_only=True``: a feature file is data and must not run code when it is read.
    """
    return specforge_sample_from(torch.load(path, map_location="cpu", weights_only=True), num_aux_layers, path)


def specforge_sample_from(raw: dict[str, Any], num_aux_layers: int, path: str | Path) -> dict[str, torch.Tensor]:
    """:func:`read_specforge_sample` of a file already loaded (``raw``: what ``torch.load`` gave;
    ``path`` for the messages), so a reader that checks the raw tensors first loads the file once."""
    missing = [key for key in SPECFORGE_KEYS if key not in raw]
    if missing:
        raise KeyError(f"{path}: a SpecForge sample file needs keys {list(SPECFORGE_KEYS)}, missing {missing}")
    aux = raw["aux_hidden_state"]
    num_tokens = int(raw["input_ids"].numel())
    if aux.shape[-1] % num_aux_layers:
        raise ValueError(f"{path}: aux_hidden_state's last axis {aux.shape[-1]} is not {num_aux_layers} layers")
    return {
        "input_ids": raw["input_ids"].reshape(num_tokens),
        "loss_mask": raw["loss_mask"].reshape(num_tokens),
        "aux_hidden_states": aux.reshape(num_tokens, num_aux_layers, aux.shape[-1] // num_aux_layers),
        "final_hidden_state": raw["hidden_state"].reshape(num_tokens, raw["hidden_state"].shape[-1]),
    }


def write_speculators_sample(path: Path, input_ids_T: torch.Tensor, hidden_TLH: torch.Tensor) -> int:
    """Write one speculators hidden-state file (``hidden_states`` ``[T, K+1, H]``, ``token_ids``)."""
    from safetensors.torch import save_file

    payload = {
        "hidden_states": hidden_TLH.contiguous(),
        "token_ids": input_ids_T.to(torch.int64).contiguous(),
    }
    return _atomic_write(path, lambda tmp: save_file(payload, str(tmp)))


def read_speculators_sample(path: str | Path) -> dict[str, torch.Tensor]:
    """One speculators hidden-state file: ``hidden_states`` ``[T, K+1, H]``, ``token_ids`` ``[T]``."""
    from safetensors.torch import load_file

    raw = load_file(str(path))
    if "hidden_states" not in raw or "token_ids" not in raw:
        raise KeyError(f"{path}: a speculators file needs 'hidden_states' and 'token_ids', has {sorted(raw)}")
    return raw
