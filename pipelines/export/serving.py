"""Export a trained draft into the directory vLLM and SGLang load as ``LlamaForCausalLMEagle3``.

``export_draft(CHECKPOINT, format, OUT)`` reads a training run's final checkpoint (given the run's
folder), the trainer's ``CHECKPOINT/draft``, or a directory holding ``config.json`` +
``model.safetensors`` directly, and writes ``OUT/config.json`` and
``OUT/model.safetensors`` per docs/design.md's serving layout (pipelines.models.serving_layout holds the
key mapping; docs/serving-layouts.md the table). The output is assembled in a temporary sibling
directory and renamed into place, so a crashed export never leaves a half-written draft that an
engine would load. The directory is world-readable (0755, files 0644): the serving engine often
runs as another user than the one who trained.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from hsstore.errors import HsstoreError
from pipelines.models.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_draft, resolve_draft_dir
from pipelines.models.serving_layout import serving_config, to_serving_state_dict

FORMATS = ("eagle3", "eagle4")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DIR_MODE, FILE_MODE = 0o755, 0o644
EMBED_TOKENS = "embed_tokens.weight"


class ExportError(HsstoreError, ValueError):
    """The checkpoint cannot be exported in the format asked for."""


def export_draft(
    checkpoint_dir: str | os.PathLike[str],
    format: str = "eagle3",  # noqa: A002 (the CLI's --format)
    out_dir: str | os.PathLike[str] = "export",
    *,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    include_embed_tokens: bool = False,
) -> Path:
    """Write the serving layout of the draft in ``checkpoint_dir`` to ``out_dir``; returns it.

    Floating-point weights are cast to ``dtype`` (the engines run bf16); ``d2t`` stays int64 and
    ``t2d`` bool. ``eagle4`` needs a draft with a candidate head (the ``candidate_head`` stage).
    ``include_embed_tokens`` adds ``embed_tokens.weight`` (the target's input embedding the draft
    was trained with): vLLM and SGLang share the target's and ignore it, but converters such as
    vLLM's ``speculators`` leave the draft's embedding unloaded without it.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{out_dir} exists and is not empty (pass --overwrite to replace it)")
    source = resolve_draft_dir(checkpoint_dir)
    # load_draft needs no target here: a trainer checkpoint holds embed_tokens (exported unless
    # include_embed_tokens); an exported directory without it cannot be exported again.
    draft = load_draft(source)
    config = draft.config
    if format == "eagle4" and draft.candidate_head is None:
        raise ExportError(
            f"{source}: format eagle4 needs a candidate head (efficient_lm_head); this draft has "
            "none. Train the candidate_head stage on it first, or export --format eagle3"
        )
    if len(config.aux_layer_ids) != 3:
        # vLLM and SGLang build fc as 3 * target_hidden_size -> hidden_size.
        raise ExportError(
            f"{source}: the engines' LlamaForCausalLMEagle3 fuses exactly 3 aux layers, this draft "
            f"uses {len(config.aux_layer_ids)} ({config.aux_layer_ids})"
        )
    if config.hidden_size != config.target_hidden_size:
        raise ExportError(
            f"{source}: hidden_size={config.hidden_size} differs from target_hidden_size="
            f"{config.target_hidden_size}; the engines share the target's embeddings, which needs them equal"
        )
    target_dtype = DTYPES[dtype]
    state = {
        name: tensor.to(target_dtype) if tensor.is_floating_point() else tensor
        for name, tensor in to_serving_state_dict(draft.state_dict(), fmt=format).items()
    }
    if include_embed_tokens:
        state[EMBED_TOKENS] = draft.embed_tokens.weight.detach().to(target_dtype).contiguous()
    cfg = serving_config(config, fmt=format, torch_dtype=dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        # mkdtemp makes the folder 0700 (and files follow the umask): readable by all instead.
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            os.chmod(staging / name, FILE_MODE)
        os.chmod(staging, DIR_MODE)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir
