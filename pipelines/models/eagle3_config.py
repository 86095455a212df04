"""The draft's shape (:class:`Eagle3Config`), saved as ``config.json`` in project checkpoints.

Kept apart from the modules in ``pipelines.models.eagle3`` (which re-exports it) so that the
serving layouts and recipes can read a draft's shape without its layers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Eagle3Config(BaseModel):
    """Shape of a draft; saved as ``config.json`` next to its weights in project checkpoints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = 1
    hidden_size: int = Field(
        gt=0, description="draft hidden size H (the engines need H == target's)"
    )
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0, description="GQA: query heads share kv heads")
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0, description="SiLU MLP width")
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0, description="from the target config")
    rope_scaling: dict[str, Any] | None = Field(
        default=None, description="None or the target's llama3 rope scaling dict"
    )
    max_position_embeddings: int = Field(default=4096, gt=0)
    vocab_size: int = Field(gt=0, description="the TARGET vocabulary size (embed_tokens rows)")
    draft_vocab_size: int = Field(gt=0, description="lm_head rows; <= vocab_size")
    target_hidden_size: int = Field(gt=0, description="H_target: fc takes K * H_target inputs")
    aux_layer_ids: list[int] = Field(
        min_length=1, description="hidden_states[i] convention: the state entering decoder layer i"
    )
    sliding_window: int | None = Field(
        default=None,
        gt=0,
        description="EAGLE-4: attend only to the last W context keys (see window_mode)",
    )
    window_mode: Literal["context", "position"] = Field(
        default="context",
        description=(
            "what the window counts at TTT depth d (docs/draft-model.md): 'context' (eagle-harness's "
            "served EAGLE-4 window) = the W most recent context keys plus the d drafted chain "
            "tokens; 'position' = keys within W RoPE positions of the drafted token "
            "(pos[t] + d - pos[s] < W, i.e. W - d context keys)"
        ),
    )
    fc_norm: bool = Field(
        default=False,
        description="EAGLE-3.1: an RMSNorm on each aux hidden state before fc (fc_norm.{k}.weight)",
    )
    norm_output: bool = Field(
        default=False,
        description="EAGLE-3.1: feed the final-normed hidden (what lm_head reads) to the next depth",
    )
    candidate_rank: int | None = Field(
        default=None, gt=0, description="EAGLE-4 stage 2 head rank r"
    )
    num_candidates: int | None = Field(
        default=None, gt=0, description="K candidates rescored exactly"
    )
    target_architecture: str | None = Field(default=None, description="e.g. Qwen3ForCausalLM")

    @model_validator(mode="after")
    def _check(self) -> Eagle3Config:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size={self.vocab_size}"
            )
        if self.num_candidates is not None and self.candidate_rank is None:
            raise ValueError("num_candidates is set but candidate_rank is not")
        if self.num_candidates is not None and self.num_candidates > self.draft_vocab_size:
            raise ValueError(
                f"num_candidates={self.num_candidates} exceeds draft_vocab_size={self.draft_vocab_size}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3)")
        return self

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def from_target_config(
        cls,
        hf_config: Any,
        *,
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        sliding_window: int | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """Derive the draft's shape from a target's Hugging Face config (object or dict).

        The draft copies the target's width, heads, MLP width, norm eps and RoPE so that it can
        share the target's embeddings. ``aux_layer_ids`` defaults to vLLM's and SGLang's
        ``[2, L//2, L-3]`` (hidden_states convention). ``overrides`` set any other field.
        """
        if hasattr(hf_config, "get_text_config"):
            hf_config = hf_config.get_text_config()
        cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        # transformers 5 keeps rope settings in ``rope_parameters``; 4.x in rope_theta/rope_scaling.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type not in (None, "default"):
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        values: dict[str, Any] = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or hidden // heads),
            "intermediate_size": int(cfg["intermediate_size"]),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
            "vocab_size": int(cfg["vocab_size"]),
            "draft_vocab_size": int(draft_vocab_size or cfg["vocab_size"]),
            "target_hidden_size": hidden,
            "aux_layer_ids": list(aux_layer_ids or [2, num_layers // 2, num_layers - 3]),
            "sliding_window": sliding_window,
            "target_architecture": (cfg.get("architectures") or [None])[0],
        }
        values.update(overrides)
        return cls(**values)


def upgrade_saved_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A saved project config as :class:`Eagle3Config` reads it today.

    Drafts saved before ``window_mode`` existed were trained with the window measured from the
    drafted position (``"position"``); without this their config would silently take the new
    default, and evaluation would apply another window than the one they were trained with.
    """
    if raw.get("sliding_window") is not None and "window_mode" not in raw:
        return {**raw, "window_mode": "position"}
    return raw
