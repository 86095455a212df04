"""The extraction recipe: a pydantic model that YAML files under ``recipes/`` map onto 1:1.

Top-level keys every extraction recipe has: ``target`` (model directory or hub id), ``data`` (list
of JSONL/Parquet paths or URLs), ``store`` (URL) and ``limit``. The sections configure one
concern each. Relative paths are relative to the working directory (run from the repository
root, as the README does). Unknown keys are refused with their dotted path.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipelines.recipe import RecipeModel

Codec = Literal["bf16", "fp8_e4m3", "float32", "int32"]
Compression = Literal["none", "zstd", "blosc"]


class ModelSection(RecipeModel):
    """How the target is loaded."""

    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="compute dtype of the target during extraction"
    )
    device: str = Field(
        "auto", description="auto (cuda when available, else cpu), cpu, cuda, cuda:N"
    )
    attn_implementation: str | None = Field(
        "sdpa", description="transformers attention implementation (sdpa, flash_attention_2, eager)"
    )
    trust_remote_code: bool = Field(
        False,
        description="run model code shipped with the checkpoint (off: it executes arbitrary code)",
    )
    revision: str | None = Field(None, description="hub revision, for hub ids only")
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each decoder layer's forward, one dynamic-shape graph for every "
        "layer and batch (pipelines/extract/compiled_layers.py). auto: on CUDA, not on a CPU; not "
        "part of the lineage (compiled and eager features agree within bf16 rounding)",
    )
    compile_backend: str = Field(
        "inductor",
        description="with compile: torch.compile's backend. inductor generates the kernels; "
        "aot_eager traces the same graph and runs it with eager kernels (no compiler toolchain: "
        "for debugging a graph break, or the CPU tests)",
    )
    compile_in_background: bool = Field(
        True,
        description="with compile: the worker starts eager and compiles on a thread of its own, the "
        "compiled layers taking over once ready (the first forward does not wait ~15 s for the "
        "compiler); false: the worker is ready only once compiled (every unit compiled, as a "
        "benchmark of the steady state wants)",
    )
    weights_loader: Literal["auto", "transformers"] = Field(
        "auto",
        description="auto: a local safetensors checkpoint is read by several threads through pinned "
        "buffers straight to the device and handed to from_pretrained (checkpoint_reader.py); "
        "transformers: from_pretrained reads the files. Not part of the lineage (same tensors)",
    )


class TokenizerSection(RecipeModel):
    """How records become tokens and loss masks."""

    path: str | None = Field(None, description="tokenizer directory; default: the target's")
    loss_mask: Literal["auto", "generation_markers", "prefix_diff"] = Field(
        "auto",
        description="how assistant tokens are found: the template's {% generation %} markers, "
        "or the prefix-diff fallback (auto: markers when the template has them)",
    )
    require_assistant: bool = Field(
        True, description="reject chat records without an assistant turn (nothing would carry loss)"
    )
    chat_template_kwargs: dict[str, object] = Field(
        default_factory=dict,
        description="extra variables for the chat template, e.g. enable_thinking",
    )


class CaptureSection(RecipeModel):
    """Which features are captured."""

    aux_layer_ids: list[int] | None = Field(
        None, description="hidden_states indices (0 = embeddings); default [2, L//2, L-3]"
    )
    final_hidden_state: bool = Field(True, description="store the post-norm final hidden state")
    target_distribution: Literal["final_hidden", "topk", "none"] = Field(
        "final_hidden",
        description="final_hidden: the trainer rebuilds logits with the lm_head; "
        "topk: also run the lm_head here and keep the top-k logits and ids; "
        "none: no distribution (aux states only; train with teacher: tokens)",
    )
    topk_k: int = Field(20, ge=1, description="k for target_distribution=topk")
    topk_chunk_tokens: int = Field(
        4096, ge=1, description="tokens per lm_head chunk (bounds memory)"
    )

    @model_validator(mode="after")
    def _final_needed(self) -> CaptureSection:
        if self.target_distribution == "final_hidden" and not self.final_hidden_state:
            raise ValueError("target_distribution=final_hidden needs final_hidden_state: true")
        if self.target_distribution == "none" and self.final_hidden_state:
            # A stored final state is a distribution (the trainer's auto would read it): say so.
            raise ValueError("target_distribution=none stores no distribution: set final_hidden_state: false")
        return self


class CodecChoice(RecipeModel):
    """Codec and compression of one feature."""

    codec: Codec = "bf16"
    compression: Compression = "none"
    compression_level: int = Field(1, ge=0, le=22)
    layer_arrays: bool = Field(
        False,
        description=(
            "aux_hidden_states only: one Zarr array per captured layer, so that training on a subset "
            "of capture.aux_layer_ids reads only those layers' bytes (FeatureSpec.layer_arrays)"
        ),
    )


class CodecsSection(RecipeModel):
    """Per-feature codecs (docs/design.md): bf16 is lossless w.r.t. a bf16 target."""

    aux_hidden_states: CodecChoice = Field(default_factory=CodecChoice)
    final_hidden_state: CodecChoice = Field(default_factory=CodecChoice)
    topk_logits: CodecChoice = Field(default_factory=lambda: CodecChoice(codec="float32"))
    chunk_bytes: int | None = Field(
        None,
        ge=1024,
        description=(
            "inner Zarr chunk target in bytes (the unit of reading); unset: FeatureSpec's "
            "token-sized default (a power of two within 2 MiB, at most 1,024 tokens)"
        ),
    )

    @field_validator("aux_hidden_states", "final_hidden_state", "topk_logits")
    @classmethod
    def _float_codec(cls, choice: CodecChoice) -> CodecChoice:
        if choice.codec == "int32":
            raise ValueError("int32 is for ids; use bf16, fp8_e4m3 or float32")
        return choice

    @field_validator("final_hidden_state", "topk_logits")
    @classmethod
    def _no_layers(cls, choice: CodecChoice) -> CodecChoice:
        if choice.layer_arrays:
            raise ValueError("layer_arrays applies to aux_hidden_states only (a [layers, H] feature)")
        return choice


class BatchingSection(RecipeModel):
    """Sequence length policy and length-bucketed batches."""

    max_length: int = Field(4096, ge=1, description="tokens per sample at most")
    too_long: Literal["drop", "truncate"] = Field(
        "drop", description="a longer sample is rejected (drop) or cut to max_length (truncate)"
    )
    token_budget: int = Field(
        16384, ge=1, description="padded tokens per forward (batch x longest)"
    )
    max_batch_size: int | None = Field(None, ge=1, description="samples per forward at most")
    pad_to_multiple_of: int = Field(
        8, ge=1, description="round the padded length up (kernel-friendly)"
    )
    pass_attention_mask: bool | Literal["auto"] = Field(
        "auto",
        description="give the model the padding mask. auto: not for the architectures where right "
        "padding and causal attention make the valid tokens' features identical without it "
        "(tested: llama, mistral, qwen2, qwen3, qwen3_moe), where SDPA then takes its faster "
        "causal kernel; yes for any other architecture",
    )

    @model_validator(mode="after")
    def _budget_holds_a_sample(self) -> BatchingSection:
        if self.token_budget < self.max_length:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be >= max_length ({self.max_length}) so "
                "that the longest sample fits in one forward"
            )
        return self


class UnitsSection(RecipeModel):
    """Work units: consecutive accepted samples, each written as one shard by one worker."""

    max_tokens: int = Field(
        1 << 18,
        ge=1,
        description="tokens per unit (= shard); a crash loses at most the units in flight",
    )
    max_samples: int = Field(4096, ge=1, description="samples per unit at most")
    sort_window_tokens: int | None = Field(
        1 << 22,
        ge=1,
        description="sort samples by length within consecutive windows of this many tokens before "
        "cutting units, so that units and their batches hold similar lengths (less padding); null: "
        "units in input order",
    )


class PlanningSection(RecipeModel):
    """How records are read and tokenized: in a stream, in parallel (pipelines/extract/planner.py)."""

    num_workers: int | None = Field(
        None, ge=1, description="tokenizing processes; default: every core this process may use"
    )
    block_records: int = Field(
        256, ge=1, description="records per tokenization task (the first block runs in process)"
    )


class PartitionSection(RecipeModel):
    """Share-nothing extraction: several processes (nodes) fill one store, each its own units.

    Every process plans the same units (planning is deterministic) and extracts those with
    ``unit index % world_size == rank``, committing to the shared store (commits are conditional
    writes, so concurrent commits lose nothing). Not part of the lineage: every rank runs the same
    extraction. The process that sees every unit committed at its end cleans up dead attempts and
    writes the complete rejects file; a rerun of any rank resumes it.
    """

    rank: int = Field(0, ge=0, description="this process's share of the units")
    world_size: int = Field(1, ge=1, description="processes sharing the units")

    @model_validator(mode="after")
    def _rank_in_range(self) -> PartitionSection:
        if self.rank >= self.world_size:
            raise ValueError(f"rank ({self.rank}) must be < world_size ({self.world_size})")
        return self


class RaySection(RecipeModel):
    """The Ray executor: one actor per GPU, or N CPU actors."""

    address: str | None = Field(None, description="cluster address; null starts Ray locally")
    num_workers: int | None = Field(
        None, ge=1, description="actors; default: the cluster's GPUs, or 1 without GPUs"
    )
    num_cpus_per_worker: float = Field(1.0, ge=0)
    num_gpus_per_worker: float | None = Field(
        None, ge=0, description="default 1 when the cluster has GPUs, else 0"
    )
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each actor needs, e.g. {extract_node: 1}: actors then go "
        "only to nodes started with `ray start --resources '{\"extract_node\": N}'` (N actors each); "
        "empty: any node with the CPUs/GPUs",
    )
    units_in_flight_per_worker: int = Field(
        2, ge=1, description="units queued per actor, so an actor never waits for the driver"
    )
    max_restarts: int = Field(3, ge=0, description="restarts of a dead actor")
    max_task_retries: int = Field(3, ge=0, description="retries of a unit whose actor died")


class ProfilerSection(RecipeModel):
    """A torch.profiler trace of each worker's first batches (pipelines/extract/profiling.py): a
    diagnostic, as vLLM's VLLM_TORCH_PROFILER_DIR is; a traced run's speed is not a measurement.
    Not part of the lineage."""

    dir: str | None = Field(
        None,
        description="folder (on each worker's machine) for the traces; null: no trace",
    )
    batches: int = Field(3, ge=1, description="forwards traced, from the start of the first unit")


class ExtractRecipe(RecipeModel):
    """``hsstore extract RECIPE``: run the target over ``data`` and fill ``store``."""

    target: str = Field(description="local model directory or hub id (AutoModelForCausalLM)")
    data: list[str] = Field(min_length=1, description="JSONL / Parquet files or fsspec URLs")
    store: str = Field(description="store URL (path, file://, memory://, s3://...)")
    storage_options: dict[str, object] = Field(
        default_factory=dict,
        description="fsspec options for the store URL (e.g. {client_kwargs: {endpoint_url: ...}}); "
        "by default s3fs reads the AWS environment (AWS_ENDPOINT_URL, keys, profile)",
    )
    limit: int | None = Field(None, ge=1, description="read at most this many records (smoke runs)")
    allow_unfinished_generation: bool = Field(
        False,
        description="read a folder of hsstore generate whose run stopped early (cut by a time limit) "
        "as its committed units; the store's lineage marks it unfinished and lists the units",
    )
    executor: Literal["auto", "local", "ray"] = Field(
        "auto",
        description="ray: actors (local Ray by default); local: same worker code in process; auto: "
        "local when the job has one worker on this machine (no ray.address, at most one GPU visible, "
        "ray.num_workers unset or 1), else ray",
    )
    model: ModelSection = Field(default_factory=ModelSection)
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    capture: CaptureSection = Field(default_factory=CaptureSection)
    codecs: CodecsSection = Field(default_factory=CodecsSection)
    batching: BatchingSection = Field(default_factory=BatchingSection)
    units: UnitsSection = Field(default_factory=UnitsSection)
    ray: RaySection = Field(default_factory=RaySection)
    partition: PartitionSection = Field(default_factory=PartitionSection)
    planning: PlanningSection = Field(default_factory=PlanningSection)
    profiler: ProfilerSection = Field(default_factory=ProfilerSection)

    @field_validator("data", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value
