"""The evaluation recipe: which target, which draft, which prompts, which decoding settings.

Every evaluation recipe has the top-level keys ``target``, ``draft``, ``prompts``,
``output_dir``, ``limit``, ``max_new_tokens`` and ``save_outputs``; ``settings`` lists the
decoding settings to measure on the same prompts (a chain, an EAGLE-2 tree, greedy or sampled).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipelines.recipe import RecipeModel


class DecodeSetting(RecipeModel):
    """One way to draft and verify: a chain (``num_draft_tokens``) or an EAGLE-2 tree."""

    name: str | None = Field(
        default=None, description="label in the results; derived from the shape when omitted"
    )
    num_draft_tokens: int | None = Field(
        default=None, gt=0, description="chain drafting: tokens drafted per step (depth, top_k 1)"
    )
    draft_top_k: int | None = Field(
        default=None,
        gt=0,
        description="tree: children expanded per frontier node and frontier width",
    )
    draft_depth: int | None = Field(default=None, gt=0, description="tree: maximum draft depth")
    total_draft_tokens: int | None = Field(
        default=None,
        gt=0,
        description="tree: draft nodes verified per step (the root excluded; EAGLE-2's total_token - 1)",
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy verification")
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="nucleus truncation when sampling"
    )

    @model_validator(mode="after")
    def _one_shape(self) -> DecodeSetting:
        tree_keys = (self.draft_top_k, self.draft_depth, self.total_draft_tokens)
        if self.num_draft_tokens is not None:
            if any(k is not None for k in tree_keys):
                raise ValueError(
                    "give either num_draft_tokens (a chain) or draft_top_k/draft_depth/"
                    "total_draft_tokens (a tree), not both"
                )
        elif any(k is None for k in tree_keys):
            raise ValueError(
                "a setting needs num_draft_tokens (a chain) or all of draft_top_k, draft_depth "
                "and total_draft_tokens (an EAGLE-2 tree)"
            )
        if self.temperature == 0.0 and self.top_p != 1.0:
            raise ValueError("top_p applies only when sampling (temperature > 0)")
        return self

    @property
    def top_k(self) -> int:
        return 1 if self.num_draft_tokens is not None else int(self.draft_top_k or 0)

    @property
    def depth(self) -> int:
        return int(self.num_draft_tokens or self.draft_depth or 0)

    @property
    def num_nodes(self) -> int:
        return int(self.num_draft_tokens or self.total_draft_tokens or 0)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        shape = (
            f"chain-{self.num_draft_tokens}"
            if self.num_draft_tokens is not None
            else f"tree-{self.draft_top_k}-{self.draft_depth}-{self.total_draft_tokens}"
        )
        if self.temperature == 0.0:
            return f"{shape}-greedy"
        top_p = f"-p{self.top_p:g}" if self.top_p < 1.0 else ""
        return f"{shape}-t{self.temperature:g}{top_p}"


class ProxyConfig(RecipeModel):
    """The offline proxy: the draft's per-depth TTT accuracy on stored features (no target run)."""

    store: str = Field(
        description="store URL (ideally extracted from data the draft did not train on)"
    )
    fraction: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="share of the store's samples used, picked by a hash of sample_id (stable)",
    )
    max_samples: int | None = Field(default=64, gt=0, description="cap on the samples scored")
    ttt_length: int = Field(default=7, gt=0, description="depths scored (the training unroll)")


class EvaluateRecipe(RecipeModel):
    """``hsstore evaluate RECIPE``: measure acceptance length by really decoding."""

    target: str = Field(description="target model directory (any AutoModelForCausalLM)")
    draft: str = Field(
        description="project checkpoint (CHECKPOINT or CHECKPOINT/draft) or exported eagle3/eagle4 dir"
    )
    prompts: str = Field(
        description="JSONL of chat records without an assistant turn, or text records"
    )
    output_dir: str = Field(description="where evaluation_results.json and .txt are written")
    limit: int | None = Field(default=None, gt=0, description="first N prompts only")
    max_new_tokens: int = Field(default=256, gt=0)
    save_outputs: bool = Field(default=False, description="include every prompt's generated ids")
    settings: list[DecodeSetting] = Field(min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field(default="auto", description="auto = cuda when available, else cpu")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        default="sdpa", description="must take a custom 4D tree mask (FlashAttention cannot)"
    )
    seed: int = 0
    baseline: bool = Field(
        default=True, description="also decode target-only (tokens/s, speedup, greedy agreement)"
    )
    warmup_tokens: int = Field(
        default=16, ge=0, description="untimed decoding before measuring (CUDA kernels, allocator)"
    )
    aux_layer_ids: list[int] | None = Field(
        default=None, description="only for third-party exports that do not record their aux layers"
    )
    proxy: ProxyConfig | None = Field(
        default=None, description="report the offline proxy next to the real acceptance length"
    )

    @model_validator(mode="after")
    def _unique_labels(self) -> EvaluateRecipe:
        labels = [s.label for s in self.settings]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"settings share the label(s) {duplicates}; give them distinct names")
        return self
