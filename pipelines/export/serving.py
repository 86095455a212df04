"""Export a trained draft into the directories the serving engines load.

``export_draft(CHECKPOINT, format, OUT)`` reads a training run's final checkpoint (given the run's
folder), the trainer's ``CHECKPOINT/draft``, or a directory holding ``config.json`` +
``model.safetensors`` directly, and writes ``OUT/config.json`` and ``OUT/model.safetensors`` in one
of three layouts (docs/serving-layouts.md has the tables):

- ``eagle3``: ``LlamaForCausalLMEagle3`` as vLLM and SGLang load it
  (``pipelines.models.serving_layout``);
- ``speculators``: speculators' own model format, which vLLM loads with no conversion step
  (``pipelines.models.speculators_layout``): the aux layer ids and the embedding included;
- ``eagle4``: eagle-harness's ``LlamaForCausalLMEagle4`` (``pipelines.models.eagle4_layout``).

Combinations an engine would serve wrong without an error are refused with what to run instead.
The output is assembled in a temporary sibling directory and renamed into place, so a crashed
export never leaves a half-written draft that an engine would load. The directory is
world-readable (0755, files 0644): the serving engine often runs as another user than the one who
trained.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from hsstore.errors import HsstoreError
from pipelines.models.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_draft, resolve_draft_dir
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.models.eagle4_layout import (
    Eagle4LayoutError,
    check_exportable,
    eagle4_config,
    to_eagle4_state_dict,
)
from pipelines.models.serving_layout import serving_config, to_serving_state_dict
from pipelines.models.speculators_layout import speculators_config, to_speculators_state_dict

logger = logging.getLogger(__name__)

FORMATS = ("eagle3", "speculators", "eagle4")
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
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    expand_vocab: bool = False,
    eagle31_keys: bool = False,
) -> Path:
    """Write the serving layout ``format`` of the draft in ``checkpoint_dir`` to ``out_dir``.

    Floating-point weights are cast to ``dtype`` (the engines run bf16); ``d2t`` stays int64 and
    ``t2d`` bool. ``include_embed_tokens`` adds the target's input embedding the draft was trained
    with to ``eagle3``/``eagle4`` (the engines share the target's; ``speculators`` always has it).
    ``verifier`` (the target's Hugging Face id or path) and ``speculative_tokens`` go into the
    ``speculators`` config; both default to the training run's recipe (``target``,
    ``ttt_length``) when the checkpoint lies in a run folder. ``expand_vocab`` writes a reduced
    draft as the full-vocabulary head ``eagle4`` needs; ``eagle31_keys`` lets ``eagle3`` carry
    EAGLE-3.1's keys, which SGLang's stock layer ignores. Returns ``out_dir``.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{out_dir} exists and is not empty (pass --overwrite to replace it)")
    source = resolve_draft_dir(checkpoint_dir)
    # load_draft needs no target here: a trainer checkpoint holds embed_tokens; an exported
    # directory without it cannot be exported again.
    draft = load_draft(source)
    check_engine_shape(draft.config, format, source)
    if format == "eagle3":
        check_eagle3(draft.config, source, eagle31_keys)
    for note in export_notes(draft.config, format):
        logger.warning("%s: %s", source, note)
    if format == "speculators":
        recipe = run_recipe(source)
        verifier = verifier_name(verifier if verifier is not None else recipe.get("target"), source)
        tokens = speculative_tokens or int(recipe.get("ttt_length") or 3)
        state, cfg = speculators_files(draft, dtype, verifier, tokens)
    else:
        state, cfg = engine_files(draft, format, dtype, source, expand_vocab)
        if include_embed_tokens:
            state[EMBED_TOKENS] = draft.embed_tokens.weight.detach().to(DTYPES[dtype]).contiguous()
    write_export(out_dir, state, cfg)
    return out_dir


def check_engine_shape(config: Eagle3Config, format: str, source: Path) -> None:  # noqa: A002
    """What every engine's EAGLE-3 layer assumes: three aux layers, the target's width."""
    if len(config.aux_layer_ids) != 3:
        # vLLM, SGLang and the harness build fc as 3 * target_hidden_size -> hidden_size.
        raise ExportError(
            f"{source}: the engines' EAGLE-3 layer fuses exactly 3 aux layers, this draft "
            f"uses {len(config.aux_layer_ids)} ({config.aux_layer_ids})"
        )
    if config.hidden_size != config.target_hidden_size:
        raise ExportError(
            f"{source}: hidden_size={config.hidden_size} differs from target_hidden_size="
            f"{config.target_hidden_size}; the engines share the target's embeddings, which needs them equal"
        )


def check_eagle3(config: Eagle3Config, source: Path, eagle31_keys: bool) -> None:
    """The eagle3 layout is what SGLang's stock ``LlamaForCausalLMEagle3`` loads: it skips
    ``fc_norm.*`` and ignores ``norm_output`` without an error, so an EAGLE-3.1 draft would be
    served wrong there."""
    if (config.fc_norm or config.norm_output) and not eagle31_keys:
        raise ExportError(
            f"{source}: an EAGLE-3.1 draft (fc_norm={config.fc_norm}, norm_output="
            f"{config.norm_output}); SGLang's LlamaForCausalLMEagle3 would drop both silently. "
            "For vLLM export --format speculators; for eagle-harness --format eagle4; to write "
            "the EAGLE-3.1 keys into this layout anyway (vLLM and TensorRT-LLM read them), pass "
            "--eagle31-keys"
        )


def export_notes(config: Eagle3Config, format: str) -> list[str]:  # noqa: A002
    """Warnings for combinations that load but may not serve as trained (printed by the CLI)."""
    notes = []
    if format == "eagle3":
        ids = json.dumps({"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids)})
        notes.append(
            "for vLLM through speculators, export --format speculators; `speculators convert` of "
            f"this directory needs --algorithm-kwargs '{ids}' (else it serves speculators' "
            "default layers) and an export with --include-embed-tokens"
        )
    windowed = config.sliding_window is not None and format in ("eagle3", "speculators")
    if windowed and config.window_mode == "context":
        notes.append(
            f"window_mode=context (W={config.sliding_window} context keys plus the chain, as "
            "eagle-harness serves); vLLM's windowed attention counts positions from the drafted "
            "token (W - d context keys at depth d) and SGLang's Eagle3 layer has no window"
        )
    return notes


def engine_files(
    draft: Eagle3Draft, format: str, dtype: str, source: Path, expand_vocab: bool  # noqa: A002
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and config of ``eagle3`` or ``eagle4``."""
    config = draft.config
    target_dtype = DTYPES[dtype]
    if format == "eagle4":
        try:
            check_exportable(config, expand_vocab=expand_vocab)
            tensors = to_eagle4_state_dict(draft.state_dict(), config)
        except Eagle4LayoutError as err:
            raise ExportError(f"{source}: {err}") from err
        cfg = eagle4_config(config, torch_dtype=dtype)
    else:
        tensors = to_serving_state_dict(draft.state_dict(), fmt=format)
        cfg = serving_config(config, fmt=format, torch_dtype=dtype)
    state = {
        name: tensor.to(target_dtype) if tensor.is_floating_point() else tensor
        for name, tensor in tensors.items()
    }
    return state, cfg


def speculators_files(
    draft: Eagle3Draft, dtype: str, verifier: str | None, speculative_tokens: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (embedding included) and config of speculators' format."""
    config = draft.config
    state = {
        name: tensor.to(DTYPES[dtype]) if tensor.is_floating_point() else tensor
        for name, tensor in to_speculators_state_dict(draft.state_dict()).items()
    }
    architectures = [config.target_architecture] if config.target_architecture else []
    cfg = speculators_config(
        config,
        torch_dtype=dtype,
        verifier=verifier,
        verifier_architectures=architectures,
        speculative_tokens=speculative_tokens,
    )
    return state, cfg


def verifier_name(verifier: str | None, source: Path) -> str:
    """The verifier as the speculators config records it: a local directory made absolute (the
    engine may start elsewhere), a Hugging Face id as given. speculators 0.9.0 reads the
    verifier's config on every load (the draft's hidden size and layer count are checked
    against it), so a format without one would not load."""
    if not verifier:
        raise ExportError(
            f"{source}: format speculators needs the target the draft was trained for (its "
            "verifier): pass --verifier NAME_OR_PATH (the draft is outside a training run, whose "
            "recipe names it)"
        )
    local = Path(verifier).expanduser()
    return str(local.resolve()) if local.is_dir() else verifier


def run_recipe(source: Path) -> dict[str, Any]:
    """The training recipe of the run ``source`` belongs to (RUN/recipe.yaml, found from
    RUN/checkpoints/NAME/draft), or {} for a draft outside a run."""
    for parent in list(source.parents)[:4]:
        path = parent / "recipe.yaml"
        if path.is_file():
            try:
                raw = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError) as err:
                raise ExportError(f"{path}: cannot read the run's recipe: {err}") from err
            return raw if isinstance(raw, dict) else {}
    return {}


def write_export(out_dir: Path, state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
    """Assemble the directory beside ``out_dir`` and rename it into place."""
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
