"""Finding and loading the target: its local directory (planning needs its config and tokenizer),
and the model itself, on one device or split over several (the worker).

torch and transformers are imported inside the loaders: the driver resolves the target while it
plans, and planning (``hsstore extract --dry-run``) loads no model code.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.extract.errors import ExtractionError, TargetNotFoundError

if TYPE_CHECKING:
    import torch

    from pipelines.extract.placement import SplitPlacement
    from pipelines.extract.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)


def resolve_target(target: str, revision: str | None = None) -> str:
    """A local directory for ``target``: itself when it exists, else a hub snapshot (needs network)."""
    if Path(target).is_dir():
        return str(Path(target))
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            target,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, gated: all say the same to the user
        raise TargetNotFoundError(
            f"target {target!r} is not a local directory and could not be fetched from the hub "
            f"({type(err).__name__}: {err})"
        ) from err


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target(
    target: str,
    *,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    weights_loader: str = "auto",
) -> torch.nn.Module:
    """The target as an eval-mode ``AutoModelForCausalLM`` on ``device`` (weights loaded there).

    ``weights_loader``: ``auto`` reads a local safetensors checkpoint with checkpoint_reader.py
    (pinned buffers, several threads) and hands the tensors to ``from_pretrained(state_dict=...)``;
    ``transformers`` lets ``from_pretrained`` read the files itself. Remote code, quantised
    checkpoints and anything without ``*.safetensors`` files always take the second way."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    kwargs: dict[str, Any] = {
        "dtype": getattr(torch, dtype),
        "trust_remote_code": trust_remote_code,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # load straight onto the GPU, no host copy of 16 GB
    model = None
    if weights_loader == "auto" and not trust_remote_code:
        model = _load_with_checkpoint_reader(target, device, kwargs)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
        logger.info("loaded %s through from_pretrained", target)
    else:
        logger.info("loaded %s through the checkpoint reader", target)
    if device.type != "cuda":
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _load_with_checkpoint_reader(target: str, device: torch.device, kwargs: dict[str, Any]) -> torch.nn.Module | None:
    """The model from checkpoint_reader's tensors, or None when the checkpoint is not one it reads."""
    import contextlib

    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from pipelines.extract.checkpoint_reader import UnsupportedCheckpoint, read_checkpoint

    files = sorted(Path(target).glob("*.safetensors"))
    if not files:
        return None
    config = AutoConfig.from_pretrained(target)
    if getattr(config, "quantization_config", None) is not None:
        return None
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        return None
    try:
        state_dict = read_checkpoint(files, device)
    except UnsupportedCheckpoint as err:
        logger.info("%s; loading through from_pretrained", err)
        return None
    # from_pretrained assigns the tensors without a copy (a dtype it must change is converted).
    model = model_class.from_pretrained(None, config=config, state_dict=state_dict, **kwargs)
    model.config._name_or_path = target  # what from_pretrained(path) records
    with contextlib.suppress(OSError):  # no generation_config.json: the config's defaults stay
        model.generation_config = GenerationConfig.from_pretrained(target)
    return model


def load_split_target(spec: WorkerSpec) -> tuple[torch.nn.Module, SplitPlacement]:
    """The target loaded on the host, then its layers split over this worker's ``num_gpus`` GPUs
    (the first ``num_gpus`` visible ones: a Ray actor sees exactly its own)."""
    import torch

    from pipelines.extract.placement import split_across_devices

    visible = torch.cuda.device_count()
    if visible < spec.num_gpus:
        raise ExtractionError(
            f"the worker should split the target over {spec.num_gpus} GPUs but sees {visible}"
        )
    model = load_target(
        spec.target,
        dtype=spec.dtype,
        device="cpu",
        attn_implementation=spec.attn_implementation,
        trust_remote_code=spec.trust_remote_code,
    )
    placement = split_across_devices(model, [f"cuda:{i}" for i in range(spec.num_gpus)])
    logger.info(
        "split the target over %d GPUs: layers on %s", spec.num_gpus, placement.layer_devices
    )
    return model, placement


def load_worker_target(
    spec: WorkerSpec, device: torch.device
) -> tuple[torch.nn.Module, torch.device, torch.device]:
    """A worker's target: on ``device``, or split over the worker's ``spec.num_gpus`` GPUs.
    Returns the model, where token ids go and where features come from."""
    if spec.num_gpus > 1:
        model, placement = load_split_target(spec)
        return model, placement.input_device, placement.output_device
    model = load_target(
        spec.target,
        dtype=spec.dtype,
        device=device,
        attn_implementation=spec.attn_implementation,
        trust_remote_code=spec.trust_remote_code,
        weights_loader=spec.weights_loader,
    )
    return model, device, device
