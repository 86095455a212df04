"""Saving and loading drafts: project checkpoints, exported serving dirs, and ``init_from``.

A project draft directory holds ``config.json`` (the :class:`Eagle3Config`) and
``model.safetensors`` (every parameter and buffer, ``embed_tokens`` included so that evaluation
needs nothing else). The trainer saves its draft as ``CHECKPOINT/draft`` with :func:`save_draft`
and keeps optimizer and loader state next to it; export and evaluation read ``CHECKPOINT/draft``.
:func:`load_draft` also reads an exported eagle3/eagle4 directory (``LlamaForCausalLMEagle3``),
whose weights omit the embeddings: pass the target's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hsstore.errors import HsstoreError
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.models.eagle3_config import upgrade_saved_config
from pipelines.models.serving_layout import (
    config_from_serving,
    is_serving_config,
    to_project_name,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class DraftCheckpointError(HsstoreError, ValueError):
    """A draft directory or weight file is missing, malformed or of the wrong shape."""


# A training run's folder (pipelines.train.trainer): RUN/checkpoints/{step_*, final}/draft.
RUN_CHECKPOINTS_DIR = "checkpoints"
FINAL_CHECKPOINT = "final"


def resolve_draft_dir(path: str | os.PathLike[str]) -> Path:
    """The draft directory ``path`` names: a training run's folder (its final checkpoint), a
    checkpoint (``CHECKPOINT/draft``), or a directory holding the draft's files itself."""
    path = Path(path)
    run_final = path / RUN_CHECKPOINTS_DIR / FINAL_CHECKPOINT / "draft"
    for candidate in (path / "draft", path, run_final):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    steps = sorted(p.name for p in (path / RUN_CHECKPOINTS_DIR).glob("step_*")) if (path / RUN_CHECKPOINTS_DIR).is_dir() else []
    if steps:
        raise DraftCheckpointError(
            f"{path}: a training run without a final checkpoint (it did not finish); name one of "
            f"its checkpoints instead, e.g. {path / RUN_CHECKPOINTS_DIR / steps[-1]}"
        )
    raise DraftCheckpointError(
        f"{path}: no draft found (expected a training run's folder with "
        f"{RUN_CHECKPOINTS_DIR}/{FINAL_CHECKPOINT}/, a checkpoint with draft/{CONFIG_NAME}, or "
        f"{CONFIG_NAME} + {WEIGHTS_NAME} directly in the directory)"
    )


def save_draft(draft: Eagle3Draft, directory: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` + ``model.safetensors``; each file goes to a temp name first and the
    config is renamed last, so a directory with a config always has matching weights."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    tmp_weights = directory / f".{WEIGHTS_NAME}.tmp"
    save_file(state, str(tmp_weights), metadata={"format": "pt"})
    os.replace(tmp_weights, directory / WEIGHTS_NAME)
    tmp_config = directory / f".{CONFIG_NAME}.tmp"
    tmp_config.write_text(draft.config.model_dump_json(indent=2) + "\n")
    os.replace(tmp_config, directory / CONFIG_NAME)
    return directory


def read_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, or of every ``*.safetensors`` in a directory."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftCheckpointError(f"{path}: no .safetensors weights found")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = handle.get_tensor(key)
    return tensors


def read_draft_config(directory: Path, aux_layer_ids: list[int] | None = None) -> Eagle3Config:
    config_path = directory / CONFIG_NAME
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DraftCheckpointError(f"{config_path}: cannot read the draft config: {err}") from err
    try:
        if is_serving_config(raw):
            return config_from_serving(raw, aux_layer_ids)
        config = Eagle3Config.model_validate(upgrade_saved_config(raw))
    except ValueError as err:
        raise DraftCheckpointError(f"{config_path}: not a valid draft config: {err}") from err
    if aux_layer_ids is not None:
        config = config.model_copy(update={"aux_layer_ids": list(aux_layer_ids)})
    return config


def load_state_into(
    draft: Eagle3Draft,
    tensors: dict[str, torch.Tensor],
    source: str,
    *,
    optional: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
) -> list[str]:
    """Copy ``tensors`` (any common EAGLE-3 naming) into ``draft``; strict about names and shapes.

    Keys in ``optional`` (prefixes) may be missing; keys in ``skip`` are ignored when present.
    Returns the project names loaded.
    """
    own = draft.state_dict()
    renamed = {to_project_name(k): v for k, v in tensors.items()}
    unexpected = sorted(k for k in renamed if k not in own and not k.startswith(skip))
    if unexpected:
        raise DraftCheckpointError(
            f"{source}: unexpected tensors {unexpected} (not part of an EAGLE-3 draft of this shape)"
        )
    missing = sorted(
        k for k in own if k not in renamed and not k.startswith(optional) and not k.startswith(skip)
    )
    if missing:
        raise DraftCheckpointError(f"{source}: missing tensors {missing}")
    names = sorted(k for k in renamed if not k.startswith(skip) and k in own)
    wrong = [
        f"{k} has shape {tuple(renamed[k].shape)}, the draft expects {tuple(own[k].shape)}"
        for k in names
        if tuple(renamed[k].shape) != tuple(own[k].shape)
    ]
    if wrong:
        raise DraftCheckpointError(
            f"{source}: tensor {'; '.join(wrong)} "
            "(different target, vocabulary, width or aux layer count?)"
        )
    with torch.no_grad():
        for name in names:
            own[name].copy_(renamed[name].to(own[name].dtype))
    loaded = names
    return loaded


def load_draft(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    embed_tokens: torch.Tensor | None = None,
    aux_layer_ids: list[int] | None = None,
) -> Eagle3Draft:
    """Load a draft from a project checkpoint (``CHECKPOINT`` or ``CHECKPOINT/draft``) or an
    exported eagle3/eagle4 directory.

    ``dtype`` None keeps the stored floating dtype (an exported bf16 draft computes in bf16).
    ``embed_tokens`` (the target's input embedding ``[V, H]``) is required for exported dirs,
    which omit it, and overrides the stored one otherwise. ``aux_layer_ids`` is only needed for
    third-party exports that do not record them.
    """
    directory = resolve_draft_dir(path)
    config = read_draft_config(directory, aux_layer_ids)
    draft = Eagle3Draft(config)
    tensors = read_weights(directory / WEIGHTS_NAME)
    has_embed = any(to_project_name(k) == "embed_tokens.weight" for k in tensors)
    if not has_embed and embed_tokens is None:
        raise DraftCheckpointError(
            f"{directory}: the weights omit embed_tokens (exported drafts share the target's); "
            "pass embed_tokens=<the target's input embedding weight>"
        )
    optional: tuple[str, ...] = ("candidate_head.",) if config.candidate_rank is None else ()
    if config.draft_vocab_size == config.vocab_size:
        optional += ("d2t",)  # a full vocabulary needs no map (eagle-harness's layout has none)
    load_state_into(
        draft, tensors, str(directory / WEIGHTS_NAME), optional=(*optional, "embed_tokens.", "t2d")
    )
    if "t2d" not in {to_project_name(k) for k in tensors}:
        # vLLM ignores t2d; rebuild it from d2t for checkpoints that leave it out.
        draft.t2d.zero_()
        draft.t2d[torch.arange(config.draft_vocab_size) + draft.d2t] = True
    if embed_tokens is not None:
        if tuple(embed_tokens.shape) != tuple(draft.embed_tokens.weight.shape):
            raise DraftCheckpointError(
                f"embed_tokens has shape {tuple(embed_tokens.shape)}, the draft in {directory} expects "
                f"{tuple(draft.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embed_tokens)
    if dtype is None:
        dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    return draft.to(device=device, dtype=dtype)


def init_from_pretrained(draft: Eagle3Draft, path: str | os.PathLike[str]) -> list[str]:
    """``init_from``: load a pretrained draft's weights (project or exported EAGLE-3 layout,
    a directory or a .safetensors file) into ``draft``, strict about names and shapes.

    The draft keeps its own ``embed_tokens`` (copied from the target) and takes the pretrained
    ``d2t``/``t2d``, since its lm_head rows only make sense with them. A candidate head is loaded
    when both sides have one. Returns the names loaded.
    """
    path = Path(path)
    weights = path / WEIGHTS_NAME if (path / WEIGHTS_NAME).is_file() else path
    if not weights.exists():
        raise DraftCheckpointError(f"init_from: {path} does not exist")
    tensors = read_weights(weights)
    skip = (
        ("embed_tokens.",)
        if draft.candidate_head is not None
        else ("embed_tokens.", "candidate_head.")
    )
    loaded = load_state_into(
        draft, tensors, f"init_from {weights}", optional=("candidate_head.", "t2d"), skip=skip
    )
    if "t2d" not in loaded:
        draft.t2d.zero_()
        draft.t2d[
            torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device) + draft.d2t
        ] = True
    return loaded
