"""Lineage: what must match between extraction and training.

Drift between how features were extracted and how a trainer reads them (another layer indexing,
pre- vs post-norm final state, another chat template or target revision) only shows up as a lower
acceptance length. The manifest pins all of it; jobs compare with :meth:`Lineage.diff` before step 1.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hsstore.aux_layers import FINAL_STATE_CONVENTION, LAYER_CONVENTION


class TargetIdentity(BaseModel):
    """Who produced the features: enough to recognise the exact same weights and config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name_or_path: str = Field(description="where the target was loaded from (informational)")
    architecture: str = Field(description="e.g. Qwen3ForCausalLM")
    model_type: str = Field(default="", description="config.model_type")
    config_sha256: str = Field(description="sha256 of the canonical config.json")
    weights_sha256: dict[str, str] = Field(
        default_factory=dict, description="weight file name -> sha256"
    )
    num_hidden_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    dtype: str = Field(default="bfloat16", description="compute dtype during extraction")


class Lineage(BaseModel):
    """Everything a consumer of the store must agree with. Recorded once, identical for all shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: TargetIdentity | None = None
    tokenizer_sha256: str | None = None
    chat_template_sha256: str | None = None
    aux_layer_ids: list[int] = Field(default_factory=list)
    layer_convention: Literal["hf_hidden_states_index"] = LAYER_CONVENTION
    final_state_convention: Literal["post_norm"] = FINAL_STATE_CONVENTION
    target_distribution: Literal["final_hidden", "topk", "draft_probs", "none"] = "final_hidden"
    max_length: int | None = None
    data_fingerprint: str | None = Field(
        default=None, description="hash of the input records and tokenisation settings"
    )
    code_version: str | None = None
    extra: dict[str, Any] = Field(
        default_factory=dict, description="job-specific settings kept for the record"
    )

    def diff(self, other: Lineage, fields: list[str] | None = None) -> list[tuple[str, Any, Any]]:
        """(dotted field, ours, theirs) for every field that differs; nested target fields included."""
        ours = self.model_dump(mode="json")
        theirs = other.model_dump(mode="json")
        out: list[tuple[str, Any, Any]] = []

        def walk(prefix: str, a: Any, b: Any) -> None:
            if isinstance(a, dict) and isinstance(b, dict):
                for key in sorted(set(a) | set(b)):
                    walk(f"{prefix}.{key}" if prefix else key, a.get(key), b.get(key))
            elif a != b:
                out.append((prefix, a, b))

        for key in fields or sorted(set(ours) | set(theirs)):
            walk(key, ours.get(key), theirs.get(key))
        return out
