"""The vLLM / SGLang ``LlamaForCausalLMEagle3`` serving layout: config keys and weight names.

One place knows how a project draft maps onto what the engines load, so that export writes it and
``load_draft`` reads it back (ours or a third-party EAGLE-3 checkpoint) with the same rules.
docs/serving-layouts.md explains every key and which engine reads it. The two other layouts
export writes live beside it (``speculators_layout``: vLLM's speculators format;
``eagle4_layout``: eagle-harness's ``LlamaForCausalLMEagle4``); :func:`is_serving_config` and
:func:`config_from_serving` recognise all three.

Aux layer ids: the project (and vLLM) use the ``hidden_states[i]`` convention: id i is the state
entering decoder layer i. vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` in that
convention. SGLang reads ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` and adds 1 before
capturing (its ids name the layer whose OUTPUT is taken), so the nested list holds ``i - 1``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.models.eagle3_config import Eagle3Config

ARCHITECTURE = "LlamaForCausalLMEagle3"

# Project parameter name -> exported name, for the keys that differ.
PROJECT_TO_SERVING = {
    "candidate_head.up_proj.weight": "efficient_lm_head.weight",
    "candidate_head.down_proj.weight": "efficient_lm_head_down_proj.weight",
}
SERVING_TO_PROJECT = {v: k for k, v in PROJECT_TO_SERVING.items()}

# Serving checkpoints share the target's embeddings, so they omit them.
NOT_EXPORTED = ("embed_tokens.weight",)

# Key under which export records the exact project config (lets load_draft round-trip losslessly).
HSSTORE_KEY = "hsstore_draft_config"


def rope_parameters(config: Eagle3Config) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of the draft (the target's RoPE)."""
    if config.rope_scaling:
        return {**config.rope_scaling, "rope_theta": config.rope_theta}
    return {"rope_type": "default", "rope_theta": config.rope_theta}


def llama_layer_keys(config: Eagle3Config) -> dict[str, Any]:
    """The one-layer Llama shape every layout states (transformers reads it as a LlamaConfig)."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
    }


def window_keys(config: Eagle3Config) -> dict[str, Any]:
    """vLLM's (and eagle-harness's) window keys: ``layer_types`` + ``sliding_window``."""
    if config.sliding_window is None:
        return {}
    return {
        "sliding_window": config.sliding_window,
        "layer_types": ["sliding_attention"],
        "use_sliding_window": True,
    }


def sglang_aux_ids(config: Eagle3Config) -> list[int]:
    """SGLang's (and eagle-harness's) nested ids name the layer whose OUTPUT is taken: ours - 1."""
    return [i - 1 for i in config.aux_layer_ids]


def serving_config(config: Eagle3Config, *, fmt: str, torch_dtype: str) -> dict[str, Any]:
    """The exported ``config.json`` of format ``eagle3`` (EAGLE-3.1 keys when the draft has them)."""
    aux_ids = list(config.aux_layer_ids)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        **llama_layer_keys(config),
        # transformers 4.x (and the engines built on it) read rope_theta/rope_scaling;
        # transformers 5 reads rope_parameters. Both say the same thing.
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "rope_parameters": rope_parameters(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        # The residual is the incoming h itself (vLLM's default; its speculators format says True).
        "norm_before_residual": False,
        "torch_dtype": torch_dtype,
        # vLLM: hidden_states[i] convention (state entering layer i).
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        # SGLang: adds 1 to these before capturing, so they are one lower.
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_aux_ids(config),
            "use_aux_hidden_state": True,
        },
        # vLLM's Llama attention takes its window from layer_types + sliding_window.
        **window_keys(config),
    }
    if config.fc_norm or config.norm_output:
        # EAGLE-3.1, as vLLM's and TensorRT-LLM's Eagle3 drafts read it (fc_norm.{k}.weight).
        out["fc_norm"] = config.fc_norm
        out["norm_output"] = config.norm_output
    out[HSSTORE_KEY] = config.model_dump(mode="json")
    return out


def is_serving_config(raw: dict[str, Any]) -> bool:
    """An exported draft of any layout export writes (its weights omit nothing the engines need
    but, unless included, the target's embedding)."""
    from pipelines.models.eagle4_layout import is_eagle4_config
    from pipelines.models.speculators_layout import is_speculators_config

    return (
        ARCHITECTURE in (raw.get("architectures") or [])
        or is_eagle4_config(raw)
        or is_speculators_config(raw)
    )


def config_from_serving(
    raw: dict[str, Any], aux_layer_ids: list[int] | None = None
) -> Eagle3Config:
    """Rebuild an :class:`Eagle3Config` from an exported (ours or third-party) ``config.json``."""
    from pipelines.models.eagle3_config import upgrade_saved_config
    from pipelines.models.eagle4_layout import config_from_eagle4, is_eagle4_config
    from pipelines.models.speculators_layout import config_from_speculators, is_speculators_config

    if is_speculators_config(raw):
        return config_from_speculators(raw, aux_layer_ids)
    if is_eagle4_config(raw):
        return config_from_eagle4(raw, aux_layer_ids)
    if HSSTORE_KEY in raw and aux_layer_ids is None:
        return Eagle3Config.model_validate(upgrade_saved_config(raw[HSSTORE_KEY]))
    if aux_layer_ids is None:
        aux_layer_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux_layer_ids is None:
        nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if nested is not None:
            aux_layer_ids = [i + 1 for i in nested]
    if aux_layer_ids is None:
        raise ValueError(
            "the config names no aux layer ids (neither eagle_aux_hidden_state_layer_ids nor "
            "eagle_config.eagle_aux_hidden_state_layer_ids); pass aux_layer_ids explicitly "
            "(the engines then default to [2, L//2, L-3] of the target's L layers)"
        )
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is None and rope_type not in (None, "default"):
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "intermediate_size": int(raw["intermediate_size"]),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        "vocab_size": int(raw["vocab_size"]),
        "draft_vocab_size": int(raw.get("draft_vocab_size") or raw["vocab_size"]),
        "target_hidden_size": int(raw.get("target_hidden_size") or hidden),
        "aux_layer_ids": list(aux_layer_ids),
        "sliding_window": raw.get("sliding_window") if raw.get("layer_types") else None,
        # A third-party window is vLLM's, measured from the drafted token's position.
        "window_mode": "position",
        "candidate_rank": raw.get("efficient_lm_head_rank"),
        "num_candidates": raw.get("num_candidates"),
        "fc_norm": bool(raw.get("fc_norm", False)),
        "norm_output": bool(raw.get("norm_output", False)),
    }
    return Eagle3Config(**cfg)


def to_serving_state_dict(state: dict[str, torch.Tensor], *, fmt: str) -> dict[str, torch.Tensor]:
    """Project state dict -> exported tensors (no ``model.`` prefix, no embed_tokens; the
    candidate head only for ``eagle4``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in NOT_EXPORTED:
            continue
        if name.startswith("candidate_head.") and fmt != "eagle4":
            continue
        out[PROJECT_TO_SERVING.get(name, name)] = tensor.contiguous()
    return out


def to_project_name(name: str) -> str:
    """Normalise a checkpoint key from any common EAGLE-3 layout to the project's name."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]
    return SERVING_TO_PROJECT.get(name, name)
