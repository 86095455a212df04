"""What a worker is told: the target, the store, the features and the batching, in one picklable
value that travels to Ray actors. Torch-free, so the driver builds it without loading model code."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hsstore import FeatureSpec
from pipelines.extract.recipe import ExtractRecipe


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable (it travels to Ray actors)."""

    target: str  # local model directory
    store: str
    features: tuple[FeatureSpec, ...]
    aux_layer_ids: tuple[int, ...]
    final_hidden_state: bool = True
    topk_k: int | None = None
    topk_chunk_tokens: int = 4096
    dtype: str = "bfloat16"
    device: str = "auto"
    attn_implementation: str | None = "sdpa"
    trust_remote_code: bool = False
    # model.compile (compiled_layers.resolve_compile). The recipe's default is "auto"; a spec built
    # by hand (benchmarks and tests that share the model with a bare forward) runs eager unless it
    # asks.
    compile: bool | str = False
    compile_backend: str = "inductor"
    compile_in_background: bool = True
    weights_loader: str = "auto"
    token_budget: int = 16384
    max_batch_size: int | None = None
    # The longest sample (batching.max_length): sets the shape of the start-up warm-up batch.
    max_length: int | None = None
    pad_to_multiple_of: int = 8
    pass_attention_mask: bool | str = "auto"  # see capture.resolve_pass_attention_mask
    pad_token_id: int = 0
    storage_options: dict[str, Any] = field(default_factory=dict)
    # GPUs this worker owns (a Ray actor with num_gpus_per_worker > 1): the target is split over
    # them (placement.py), for targets larger than one GPU.
    num_gpus: int = 1
    # profiler.dir / profiler.batches: a trace of the first unit's first batches (profiling.py).
    profile_dir: str | None = None
    profile_batches: int = 3

    @classmethod
    def from_recipe(
        cls,
        recipe: ExtractRecipe,
        *,
        target_dir: str,
        features: Sequence[FeatureSpec],
        aux_layer_ids: Sequence[int],
        pad_token_id: int,
    ) -> WorkerSpec:
        """The recipe's worker settings; ``target_dir``: the target resolved to a local folder.

        ``num_gpus`` stays 1: the Ray executor sets it from ``ray.num_gpus_per_worker``."""
        capture = recipe.capture
        return cls(
            target=target_dir,
            store=recipe.store,
            storage_options=dict(recipe.storage_options),
            features=tuple(features),
            aux_layer_ids=tuple(aux_layer_ids),
            final_hidden_state=capture.final_hidden_state,
            topk_k=capture.topk_k if capture.target_distribution == "topk" else None,
            topk_chunk_tokens=capture.topk_chunk_tokens,
            dtype=recipe.model.dtype,
            device=recipe.model.device,
            attn_implementation=recipe.model.attn_implementation,
            trust_remote_code=recipe.model.trust_remote_code,
            compile=recipe.model.compile,
            compile_backend=recipe.model.compile_backend,
            compile_in_background=recipe.model.compile_in_background,
            weights_loader=recipe.model.weights_loader,
            token_budget=recipe.batching.token_budget,
            max_batch_size=recipe.batching.max_batch_size,
            max_length=recipe.batching.max_length,
            pad_to_multiple_of=recipe.batching.pad_to_multiple_of,
            pass_attention_mask=recipe.batching.pass_attention_mask,
            pad_token_id=int(pad_token_id),
            profile_dir=recipe.profiler.dir,
            profile_batches=recipe.profiler.batches,
        )
