"""A target split over the GPUs of one extraction worker, for targets larger than one GPU.

``ray.num_gpus_per_worker: N`` gives each actor N GPUs; the worker loads the target on the host and
places its decoder layers in N contiguous blocks, one block per GPU (the embeddings on the first,
the final norm and the lm_head on the last). A forward pre-hook on each block's first layer moves
the hidden states and the layer's other inputs (rotary tables, masks) to its GPU, so a batch flows
GPU 0 -> 1 -> ... like transformers' ``device_map`` with accelerate's hooks, without needing
accelerate. GPUs take turns (one batch at a time, no micro-batch pipelining): the point is memory,
not speed; a target that fits one GPU extracts faster with one actor per GPU.

Captured features are gathered on the last GPU (:attr:`SplitPlacement.output_device`), where the
final norm runs; the aux states of earlier blocks cross over NVLink/PCIe, a few MB per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipelines.extract.capture import find_decoder_parts


@dataclass(frozen=True)
class SplitPlacement:
    """Where a split target's parts went: inputs go to ``input_device``, features come from
    ``output_device``; ``layer_devices[i]`` holds decoder layer ``i``."""

    input_device: torch.device
    output_device: torch.device
    layer_devices: tuple[torch.device, ...]


def move_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (tuples, lists, dicts) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(move_to(v, device) for v in value)
    if isinstance(value, list):
        return [move_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value


def _inputs_to(device: torch.device) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return move_to(args, device), move_to(kwargs, device)

    return hook


def split_across_devices(model: nn.Module, devices: Sequence[torch.device | str]) -> SplitPlacement:
    """Place ``model`` (a causal LM, e.g. loaded on the host) over ``devices``, in place.

    Layer ``i`` of ``L`` goes to ``devices[i * N // L]``: contiguous, equal blocks. The embeddings
    and everything else outside the decoder layers go to the first device; the final norm, and the
    lm_head unless it shares the embeddings' weight, to the last.
    """
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("split_across_devices needs at least one device")
    parts = find_decoder_parts(model)
    layers = parts.layers
    num_layers = len(layers)
    if len(devices) > num_layers:
        raise ValueError(f"{num_layers} decoder layers cannot be split over {len(devices)} devices")
    first, last = devices[0], devices[-1]
    # Everything but the layers to the first device: detach the layer list while moving the rest.
    owner = next(m for m in model.modules() if any(child is layers for child in m.children()))
    name = next(n for n, child in owner.named_children() if child is layers)
    setattr(owner, name, nn.ModuleList())
    try:
        model.to(first)
    finally:
        setattr(owner, name, layers)
    layer_devices = []
    for index, layer in enumerate(layers):
        device = devices[index * len(devices) // num_layers]
        layer.to(device)
        layer.register_forward_pre_hook(_inputs_to(device), with_kwargs=True)
        layer_devices.append(device)
    parts.final_norm.to(last)
    parts.final_norm.register_forward_pre_hook(_inputs_to(last), with_kwargs=True)
    lm_head = parts.lm_head
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = lm_head is not None and embeddings is not None and lm_head.weight is embeddings.weight
    if lm_head is not None and not tied:
        lm_head.to(last)
        lm_head.register_forward_pre_hook(_inputs_to(last), with_kwargs=True)
    elif lm_head is not None:
        lm_head.register_forward_pre_hook(_inputs_to(first), with_kwargs=True)
    # The base model's own inputs (token ids, masks) go where the embeddings are.
    parts.base.register_forward_pre_hook(_inputs_to(first), with_kwargs=True)
    return SplitPlacement(first, last, tuple(layer_devices))
