"""The training recipe: one pydantic model per section, YAML mapped 1:1 onto it.

Every training recipe has the top-level keys ``store``, ``target``, ``output_dir`` and ``max_steps``
(the last overrides the schedule's length, for smoke runs). ``model`` picks the draft family
(``eagle3``, or ``eagle4``: the same layer, usually with a ``draft.sliding_window``); ``stage`` picks
what is trained (``draft``, or ``candidate_head``: EAGLE-4 stage 2 on a frozen stage-1 draft).
Contradictions are refused on construction with the dotted key, so a bad sweep fails before the
store is opened.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.recipe import RecipeModel
from pipelines.train.teacher_mode import TeacherChoice


class VocabConfig(RecipeModel):
    """The draft vocabulary: calibrated from the store, read from a file, or the full target vocab."""

    draft_vocab_size: int | None = Field(
        default=None,
        gt=0,
        description="keep the N most frequent loss-masked target ids of the store (32000 for 150k-vocab targets)",
    )
    vocab_file: str | None = Field(
        default=None, description="a trimmed-vocabulary JSON (target ids kept) instead of calibrating"
    )
    full: bool = Field(default=False, description="use the whole target vocabulary (no d2t offsets)")

    @model_validator(mode="after")
    def _one_source(self) -> VocabConfig:
        chosen = [
            name
            for name, on in (
                ("draft_vocab_size", self.draft_vocab_size is not None),
                ("vocab_file", self.vocab_file is not None),
                ("full", self.full),
            )
            if on
        ]
        if len(chosen) != 1:
            raise ValueError(
                "set exactly one of draft_vocab_size, vocab_file, full: true "
                f"(found {', '.join(chosen) or 'none'})"
            )
        return self


class DraftConfig(RecipeModel):
    """The draft layer's shape. ``None`` copies the target's value (the engines need hidden_size equal
    to the target's, which is therefore not a knob)."""

    num_attention_heads: int | None = Field(default=None, gt=0)
    num_key_value_heads: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    intermediate_size: int | None = Field(default=None, gt=0)
    sliding_window: int | None = Field(
        default=None, gt=0, description="EAGLE-4: attend to the last W context keys (>= ttt_length)"
    )
    window_mode: Literal["context", "position"] = Field(
        default="context",
        description=(
            "what the window counts at TTT depth d: 'context' = the W most recent context keys "
            "plus the d drafted chain tokens (what eagle-harness serves for EAGLE-4); 'position' "
            "= keys within W positions of the drafted token (W - d context keys)"
        ),
    )
    fc_norm: bool = Field(
        default=False, description="EAGLE-3.1: RMSNorm each aux hidden state before fc"
    )
    norm_output: bool = Field(
        default=False,
        description="EAGLE-3.1: feed the final-normed hidden (what lm_head reads) to the next TTT depth",
    )
    vocab: VocabConfig = Field(default_factory=lambda: VocabConfig(draft_vocab_size=32000))


class CandidateHeadConfig(RecipeModel):
    """EAGLE-4 stage 2: a rank-r head whose top ``num_candidates`` the server rescores exactly."""

    rank: int = Field(default=256, gt=0, description="r of the factors down [r, H] and up [V_draft, r]")
    num_candidates: int = Field(default=64, gt=0, description="K for recall@K")
    draft_checkpoint: str | None = Field(
        default=None, description="stage-1 checkpoint directory (its draft/ is loaded and frozen)"
    )


class OptimizerConfig(RecipeModel):
    lr: float = Field(default=1e-4, gt=0, description="peak learning rate (AdamW)")
    betas: tuple[float, float] = Field(default=(0.9, 0.95))
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float | None = Field(default=0.5, gt=0, description="max global grad norm; null = off")

    @model_validator(mode="after")
    def _check_betas(self) -> OptimizerConfig:
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        return self


class ScheduleConfig(RecipeModel):
    """Linear warmup then cosine decay to ``min_lr_ratio * lr`` over ``epochs`` (or ``max_steps``)."""

    epochs: int = Field(default=1, gt=0, description="passes over the store")
    warmup_steps: int = Field(default=50, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)


class LoaderConfig(RecipeModel):
    """How the store is streamed (hsstore.loader): packing, shuffling, partitioning, reads."""

    token_budget: int = Field(default=4096, gt=0, description="tokens per packed row (sequence length)")
    rows_per_batch: int = Field(default=1, gt=0, description="packed rows per step and rank")
    shuffle_window: int = Field(default=1024, gt=0, description="samples shuffled together (py1e window)")
    remainder: Literal["drop", "wrap"] = Field(
        default="drop",
        description="batches that do not divide evenly across ranks: dropped, or filled from the epoch's start",
    )
    long_samples: Literal["error", "truncate"] = Field(
        default="error", description="samples longer than token_budget: refuse, or truncate (counted)"
    )
    num_workers: int = Field(default=0, ge=0, description="DataLoader worker processes per rank")
    read_threads: int | None = Field(
        default=None,
        gt=0,
        description="token-range reads in flight per loader; default 4 for a local store, 64 for object "
        "storage (requests in flight hide its latency and its rate per connection)",
    )
    prefetch_batches: int | None = Field(
        default=None,
        gt=0,
        description="batches read ahead of the step; default 4 for a local store, 8 for object storage "
        "(reads land in the batches being read ahead, so these bound the reads in flight)",
    )
    cache_dir: str | None = Field(
        default=None,
        description=(
            "remote stores (s3://, gs://...): keep the bytes read in this local folder, so later "
            "epochs and resumed runs read them locally (hsstore.read_cache; shareable by processes)"
        ),
    )
    cache_max_bytes: int = Field(
        default=64 << 30, gt=0, description="bound of cache_dir; least recently used ranges are evicted past it"
    )


class TrainRecipe(RecipeModel):
    """``hsstore train RECIPE``: what is trained, from which store, against which target."""

    store: str = Field(description="store URL (local path or any fsspec URL)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "fsspec options for the store, e.g. {client_kwargs: {endpoint_url: ...}} for an "
            "S3-compatible endpoint; empty: s3fs reads AWS_ENDPOINT_URL and the keys from the environment"
        ),
    )
    target: str = Field(description="target model directory (only embed/norm/lm_head are read)")
    output_dir: str = Field(description="metrics.jsonl, checkpoints/step_N, checkpoints/final")
    max_steps: int | None = Field(
        default=None, gt=0, description="stop after this many optimizer steps (overrides the schedule's length)"
    )
    model: Literal["eagle3", "eagle4"] = Field(default="eagle3", description="draft family")
    stage: Literal["draft", "candidate_head"] = Field(default="draft", description="what is trained")
    draft: DraftConfig = Field(default_factory=DraftConfig)
    candidate_head: CandidateHeadConfig = Field(default_factory=CandidateHeadConfig)
    ttt_length: int = Field(default=7, gt=0, description="training-time-test unroll depth")
    loss_decay: float = Field(default=0.8, gt=0, le=1, description="weight decay^i of depth i's loss")
    loss_normalization: Literal["scored", "tokens"] = Field(
        default="scored",
        description=(
            "what each depth's summed loss is divided by: the positions it scores in the step "
            "(every step weighs the same) or the step's real tokens (every scored token weighs the "
            "same across steps, as SpecForge's B*T mean; docs/training.md)"
        ),
    )
    teacher: TeacherChoice = Field(
        default="auto", description="which stored target distribution to learn from (auto: the best present)"
    )
    init_from: str | None = Field(
        default=None,
        description="a pretrained draft (checkpoint dir, exported dir or .safetensors) to start from",
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    bf16: bool = Field(default=True, description="bf16 autocast for the draft's matmuls (CUDA only)")
    grad_accum_steps: int = Field(
        default=1, gt=0, description="micro-batches per optimizer step (each rank's batch = rows_per_batch rows)"
    )
    attention: Literal["auto", "flex", "segmented", "eager"] = Field(
        default="auto",
        description="TTT attention: fused block-sparse flex_attention (auto on CUDA), per-document dense "
        "attention (auto elsewhere) or the eager dense-mask reference; all give the same result",
    )
    compile: Literal["auto", "off", "on", "layers", "step", "graph"] = Field(
        default="auto",
        description=(
            "how much of the step torch.compile sees (pipelines.train.compile_modes): layers = the "
            "draft's norms/MLP, flex attention and the loss kernel alone (on: the same); step = the "
            "whole objective forward as one graph, every position scored densely; graph = step "
            "replayed as CUDA graphs (CUDA, one process, no accumulation); auto = graph on CUDA (step "
            "with several processes or accumulation) when >= 60% of the store's tokens are scored, else "
            "layers; off elsewhere"
        ),
    )
    fp8: bool = Field(
        default=False,
        description=(
            "the draft's fc, q/k/v/o and MLP matmuls in FP8 (e4m3 forward, e5m2 gradients, per-tensor "
            "dynamic scales; lm_head, norms and attention unchanged). Needs FP8 matmuls on the device "
            "(CUDA compute capability 8.9+: Ada, Hopper), refused otherwise"
        ),
    )
    seed: int = Field(default=0, ge=0, description="model init and the loader's order")
    checkpoint_every: int | None = Field(default=None, gt=0, description="steps between checkpoints")
    keep_checkpoints: int | None = Field(default=None, gt=0, description="keep the newest N step_* dirs")
    log_every: int = Field(default=10, gt=0, description="steps between metrics.jsonl lines")
    skip_corrupt: bool = Field(
        default=False,
        description="skip (and count) samples whose shard fails to read instead of stopping",
    )
    device: str = Field(default="auto", description="auto (cuda if present), cpu, cuda, cuda:N")
    resume: bool = Field(default=True, description="continue from the newest checkpoint in output_dir")
    verify_weights: bool = Field(
        default=True,
        description="hash the target's weight files for the lineage check (~40 s for 16 GB unless HF-cached)",
    )
    aux_layer_ids: list[int] | None = Field(
        default=None,
        description=(
            "train on these aux layers (ids, in this order), a subset of the store's captured "
            "lineage aux_layer_ids; null: all of them. The draft's fc takes len(ids) * H inputs and "
            "export/evaluation carry these ids"
        ),
    )
    expect_aux_layer_ids: list[int] | None = Field(
        default=None, description="refuse a store whose aux layers differ (lineage check)"
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean: `compile: off` must still mean "off".
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainRecipe:
        window = self.draft.sliding_window
        if window is not None and window < self.ttt_length:
            raise ValueError(
                f"draft.sliding_window={window} is smaller than ttt_length={self.ttt_length}: "
                "depth i attends to its own keys of depths 1..i, which a shorter window would cut"
            )
        if self.stage == "candidate_head" and self.candidate_head.draft_checkpoint is None:
            raise ValueError(
                "candidate_head.draft_checkpoint is required when stage is candidate_head "
                "(the stage-1 draft to freeze)"
            )
        if self.stage == "candidate_head" and self.init_from is not None:
            raise ValueError("init_from does not apply to stage candidate_head (use candidate_head.draft_checkpoint)")
        if self.stage == "candidate_head" and (self.fp8 or self.compile in ("step", "graph")):
            raise ValueError(
                "fp8 and compile: step/graph apply to stage draft; stage candidate_head trains a "
                "low-rank head on a frozen draft and runs eager (set fp8: false, compile: auto)"
            )
        if self.compile in ("step", "graph") and self.attention == "segmented":
            raise ValueError(
                f"compile: {self.compile} traces the attention; attention: segmented reads document "
                "bounds on the host and cannot be traced (use auto, flex or eager)"
            )
        if self.compile == "graph" and self.grad_accum_steps > 1:
            raise ValueError(
                f"compile: graph does not accumulate gradients (grad_accum_steps={self.grad_accum_steps}): "
                "a CUDA graph's next replay overwrites the gradients it produced; use compile: step"
            )
        if self.loader.token_budget <= self.ttt_length:
            raise ValueError(
                f"loader.token_budget={self.loader.token_budget} must exceed ttt_length={self.ttt_length}"
            )
        return self
