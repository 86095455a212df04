"""speculators' own EAGLE-3 model format (speculators 0.9.0), which vLLM loads with no conversion.

``config.json`` is an ``Eagle3SpeculatorConfig``: ``speculators_model_type: "eagle3"``, the decoder
layer's shape as a nested ``transformer_layer_config`` (a one-layer LlamaConfig), the aux layer ids
(``eagle_aux_hidden_state_layer_ids``, the ``hidden_states[i]`` convention, as ours and vLLM's), the
EAGLE-3.1 switches (``fc_norm``, ``norm_output``) and a ``speculators_config`` section naming the
verifier (the target) and the proposal method. The weights use speculators' module names
(``layers.0.*`` for our ``midlayer.*``) and include ``embed_tokens.weight``: speculators loads the
draft's embedding from the checkpoint (from the verifier only when it is missing, and only when the
verifier is reachable), so a directory without it would compute with an uninitialised table.

Writing the ids ourselves is the point: ``speculators convert`` of an ``eagle3`` export leaves them
``null`` and speculators then picks its default ``[2, L//2, L-3]``, serving a draft trained on
another layer subset on the wrong layers with no error.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.models.eagle3_config import Eagle3Config, upgrade_saved_config
from pipelines.models.serving_layout import HSSTORE_KEY, llama_layer_keys, rope_parameters

MODEL_TYPE = "eagle3"
ARCHITECTURE = "Eagle3DraftModel"  # what speculators' save_pretrained writes
SPECULATORS_VERSION = "0.9.0"


def speculators_config(
    config: Eagle3Config,
    *,
    torch_dtype: str,
    verifier: str | None,
    verifier_architectures: list[str],
    speculative_tokens: int,
) -> dict[str, Any]:
    """The ``config.json`` speculators' ``Eagle3DraftModel.from_pretrained`` (and vLLM) reads."""
    layer: dict[str, Any] = {**llama_layer_keys(config), "rope_parameters": rope_parameters(config)}
    if config.sliding_window is not None:
        # speculators and vLLM take a draft layer's window from layer_types + sliding_window.
        layer["sliding_window"] = config.sliding_window
        layer["layer_types"] = ["sliding_attention"]
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        # The residual is the incoming h itself, not its hidden_norm (our layer, and speculators'
        # default).
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": torch_dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        # Ignored by speculators (its configs keep unknown keys) and vLLM; load_draft reads it.
        HSSTORE_KEY: config.model_dump(mode="json"),
    }


def to_speculators_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Project state dict -> speculators' tensor names (``midlayer.`` -> ``layers.0.``), the
    embedding included, the EAGLE-4 candidate head left out (speculators' EAGLE-3 has none)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("candidate_head."):
            continue
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        out[name] = tensor.contiguous()
    return out


def is_speculators_config(raw: dict[str, Any]) -> bool:
    return raw.get("speculators_model_type") == MODEL_TYPE


def config_from_speculators(
    raw: dict[str, Any], aux_layer_ids: list[int] | None = None
) -> Eagle3Config:
    """An :class:`Eagle3Config` from a speculators EAGLE-3 ``config.json`` (ours or third-party)."""
    if HSSTORE_KEY in raw and aux_layer_ids is None:
        return Eagle3Config.model_validate(upgrade_saved_config(raw[HSSTORE_KEY]))
    unsupported = [key for key in ("norm_before_residual", "norm_before_fc") if raw.get(key)]
    if unsupported:
        raise ValueError(
            f"speculators config sets {unsupported}: the project's draft layer implements neither "
            "(its residual is the un-normed h; EAGLE-3.1's per-layer fc_norm is supported)"
        )
    layer = raw.get("transformer_layer_config") or {}
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"speculators config has {layer['num_hidden_layers']} draft layers; the project's "
            "draft has one"
        )
    ids = aux_layer_ids if aux_layer_ids is not None else raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        raise ValueError(
            "speculators config has eagle_aux_hidden_state_layer_ids: null (speculators would use "
            "[2, L//2, L-3] of the verifier's L layers); pass aux_layer_ids explicitly"
        )
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    layer_types = layer.get("layer_types") or []
    return Eagle3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        rope_scaling=(
            None if rope_type in (None, "default") else {k: v for k, v in rope.items() if k != "rope_theta"}
        ),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        aux_layer_ids=list(ids),
        sliding_window=layer.get("sliding_window") if "sliding_attention" in layer_types else None,
        # vLLM windows the draft's keys by position (the drafted token's).
        window_mode="position",
        fc_norm=bool(raw.get("fc_norm", False)),
        norm_output=bool(raw.get("norm_output", False)),
    )
