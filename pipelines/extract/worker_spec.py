"""What a worker is told: the target, the store, the features and the batching, in one picklable
value that travels to Ray actors. Torch-free, so the driver builds it without loading model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hsstore import FeatureSpec


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

