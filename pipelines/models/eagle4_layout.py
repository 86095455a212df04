"""eagle-harness's ``LlamaForCausalLMEagle4`` layout (eagle-harness 0.1.3, EAGLE-4's serving
plugin for SGLang, vLLM and TokenSpeed), written by ``hsstore export --format eagle4``.

What the harness checks (its engine-free ``validate_eagle4_draft_config`` / ``check_ported``, and
its weight loaders), and so what this layout is:

- ``architectures: ["LlamaForCausalLMEagle4"]``, a one-layer LlamaConfig plus only the keys on its
  whitelist: no project metadata, no top-level aux ids (an unknown key fails construction).
- the candidate head as ``efficient_lm_head_config: {type: "low_rank", rank, num_candidates}``.
- a FULL vocabulary: ``lm_head`` ``[V, H]``, ``efficient_lm_head`` ``[V, r]``,
  ``efficient_lm_head_down_proj`` ``[r, H]``; no ``d2t``/``t2d`` (its loader raises KeyError on
  any tensor it has no parameter for). A reduced draft is refused, or expanded when asked
  (:func:`expand_to_full_vocab`).
- aux ids only as ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention (ours
  minus 1; its vLLM adapter adds the 1 back), exactly three of them.
- a window via ``sliding_window`` + ``layer_types`` + ``use_sliding_window``, served as "at depth d
  the W most recent context keys plus the d chain tokens": the project's ``window_mode: context``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.models.eagle3_config import Eagle3Config
from pipelines.models.serving_layout import (
    llama_layer_keys,
    rope_parameters,
    sglang_aux_ids,
    window_keys,
)

ARCHITECTURE = "LlamaForCausalLMEagle4"
HEAD_TYPE = "low_rank"

# Project parameter name -> the harness's tensor name, for the names that differ.
PROJECT_TO_EAGLE4 = {
    "candidate_head.up_proj.weight": "efficient_lm_head.weight",
    "candidate_head.down_proj.weight": "efficient_lm_head_down_proj.weight",
}
NOT_EXPORTED = ("embed_tokens.weight", "d2t", "t2d")


class Eagle4LayoutError(ValueError):
    """The draft cannot be written in the layout eagle-harness loads (the message says why)."""


def check_exportable(config: Eagle3Config, *, expand_vocab: bool) -> None:
    """Refuse drafts the harness would refuse, or serve differently from how they were trained."""
    problems = []
    if config.candidate_rank is None or config.num_candidates is None:
        problems.append(
            "it has no candidate head (efficient_lm_head); train the candidate_head stage on it"
        )
    if config.num_aux_layers != 3:
        problems.append(f"the harness fuses exactly 3 aux layers, this draft uses {config.aux_layer_ids}")
    if config.sliding_window is not None and config.window_mode != "context":
        problems.append(
            "it was trained with window_mode=position (W - d context keys at depth d); the "
            "harness serves W context keys plus the d chain tokens. Retrain with "
            "draft.window_mode=context"
        )
    if config.draft_vocab_size != config.vocab_size and not expand_vocab:
        problems.append(
            f"its vocabulary is reduced ({config.draft_vocab_size} of {config.vocab_size}; the "
            "harness serves full-vocabulary drafts only). Train with draft.vocab.full=true, or "
            "pass --expand-vocab (rows of the target ids outside the draft vocabulary are zero: "
            "logit 0 in both heads, see docs/serving-layouts.md)"
        )
    if problems:
        raise Eagle4LayoutError("cannot export as eagle4: " + "; ".join(problems))


def eagle4_config(config: Eagle3Config, *, torch_dtype: str) -> dict[str, Any]:
    """The harness's ``config.json`` (full vocabulary: ``draft_vocab_size == vocab_size``)."""
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_keys(config),
        # transformers 5's key: rope_theta/rope_scaling at the top level are not whitelisted.
        "rope_parameters": rope_parameters(config),
        "dtype": torch_dtype,
        "draft_vocab_size": config.vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "num_aux_hidden_states": 3,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_aux_ids(config),
            "use_aux_hidden_state": True,
        },
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        **window_keys(config),
        "efficient_lm_head_config": {
            "type": HEAD_TYPE,
            "rank": config.candidate_rank,
            "num_candidates": config.num_candidates,
        },
    }


def expand_to_full_vocab(
    weight_DH: torch.Tensor, d2t: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """A head over the draft vocabulary ``[V_d, *]`` as one over the target's ``[V, *]``: row
    ``d + d2t[d]`` is draft row d, every other row zero (logit 0). The draft's logits over its
    own ids are unchanged; a token outside them scores 0, so it is drafted only where every
    in-vocabulary logit is below 0."""
    full = weight_DH.new_zeros((vocab_size, *weight_DH.shape[1:]))
    target_ids = torch.arange(weight_DH.shape[0], device=d2t.device) + d2t
    full[target_ids] = weight_DH
    return full


def to_eagle4_state_dict(
    state: dict[str, torch.Tensor], config: Eagle3Config
) -> dict[str, torch.Tensor]:
    """Project state dict -> the harness's tensors (full vocabulary, no vocabulary maps)."""
    out: dict[str, torch.Tensor] = {}
    d2t = state["d2t"]
    for name, tensor in state.items():
        if name in NOT_EXPORTED:
            continue
        if name in ("lm_head.weight", "candidate_head.up_proj.weight"):
            if config.draft_vocab_size != config.vocab_size:
                tensor = expand_to_full_vocab(tensor, d2t, config.vocab_size)
            elif bool(d2t.any()):
                raise Eagle4LayoutError(
                    "a full-vocabulary draft whose d2t is not the identity: its lm_head rows are "
                    "not in target-id order"
                )
        out[PROJECT_TO_EAGLE4.get(name, name)] = tensor.contiguous()
    return out


def is_eagle4_config(raw: dict[str, Any]) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or [])


def config_from_eagle4(raw: dict[str, Any], aux_layer_ids: list[int] | None = None) -> Eagle3Config:
    """An :class:`Eagle3Config` from a harness ``config.json`` (no project metadata is kept)."""
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux_layer_ids is None and nested is None:
        raise ValueError("the EAGLE-4 config names no aux layers (eagle_config.eagle_aux_hidden_state_layer_ids)")
    head = raw.get("efficient_lm_head_config") or {}
    if head and head.get("type") != HEAD_TYPE:
        raise ValueError(f"efficient_lm_head_config type {head.get('type')!r} is not supported (low_rank)")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    layer_types = raw.get("layer_types") or []
    windowed = "sliding_attention" in layer_types or (
        not layer_types and raw.get("use_sliding_window", raw.get("sliding_window") is not None)
    )
    return Eagle3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or 10000.0),
        rope_scaling=None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        vocab_size=int(raw["vocab_size"]),
        draft_vocab_size=int(raw["vocab_size"]),
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else [i + 1 for i in nested],
        sliding_window=raw.get("sliding_window") if windowed else None,
        window_mode="context",
        fc_norm=bool(raw.get("fc_norm", False) or raw.get("enable_fc_norm", False)),
        norm_output=bool(raw.get("norm_output", False)),
        candidate_rank=head.get("rank"),
        num_candidates=head.get("num_candidates"),
    )
