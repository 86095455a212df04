"""The generation recipe: ``hsstore generate RECIPE`` maps a YAML file onto :class:`GenerateRecipe`.

Top-level keys: ``target`` (model directory or hub id), ``data`` (JSONL / Parquet files, the
formats extraction reads), ``output`` (the generated dataset's folder) and ``limit``. Sections
configure one concern each; unknown keys are refused with their dotted path. The model and Ray
sections are extraction's own (:mod:`pipelines.extract.recipe`), so a target loads the same way in
both jobs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipelines.extract.recipe import ModelSection, RaySection
from pipelines.recipe import RecipeModel


class PromptingSection(RecipeModel):
    """How records become prompts (docs/generate.md, 'What is regenerated')."""

    text_prefix_tokens: int = Field(
        128,
        ge=1,
        description="raw text records: the first N tokens become the prompt of a continuation",
    )
    chat_template_kwargs: dict[str, object] = Field(
        default_factory=dict,
        description="extra variables for the chat template, e.g. {enable_thinking: false}",
    )
    tokenizer: str | None = Field(None, description="tokenizer directory; default: the target's")
    max_context: int | None = Field(
        None,
        ge=2,
        description="prompt + answer tokens at most; default: the target's max_position_embeddings. "
        "A prompt that leaves no room for one new token is rejected (too_long); a longer answer "
        "is cut at the context and marked truncated",
    )


class SamplingSection(RecipeModel):
    """How the next token is chosen. Part of the lineage: it says how the answers were written."""

    temperature: float = Field(
        0.0, ge=0.0, description="0: greedy (argmax); > 0: sample from softmax(logits / temperature)"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass (1: off)")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: off)")
    seed: int = Field(
        0,
        ge=0,
        description="with the record's id and the turn, seeds each answer's sampler: a rerun "
        "regenerates the same text",
    )
    max_new_tokens: int = Field(512, ge=1, description="tokens per answer at most")
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="stop tokens besides the target's EOS ids (generation_config.json, tokenizer)",
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class BatchingSection(RecipeModel):
    """Batches of the transformers backend: length-sorted prompts, left-padded, one KV cache."""

    max_batch_size: int = Field(64, ge=1, description="answers generated together at most")
    token_budget: int = Field(
        65536,
        ge=1,
        description="(longest prompt + max_new_tokens) x batch at most: bounds the KV cache",
    )
    max_padding_share: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="a batch is cut before its left padding passes this share of its prompt "
        "tokens (padding is computed in the prefill); 1: cut by size and budget only",
    )


class UnitsSection(RecipeModel):
    """Work units: consecutive records, each written as one output shard (the unit of resume)."""

    max_records: int = Field(
        256, ge=1, description="records per unit (= shard); a crash loses at most the units in flight"
    )


class OutputSection(RecipeModel):
    """The shards' file format."""

    format: Literal["jsonl", "parquet"] = Field(
        "jsonl", description="jsonl: one record per line; parquet: one row per record"
    )


class OpenAISection(RecipeModel):
    """``backend: openai``: an OpenAI-compatible server (vLLM, SGLang) that already serves the target."""

    base_url: str = Field(
        "http://127.0.0.1:8000/v1", description="the server's /v1 URL (chat/completions, completions)"
    )
    model: str | None = Field(None, description="the served model's name; default: target")
    api_key_env: str | None = Field(
        None, description="environment variable holding the API key (sent as a Bearer token)"
    )
    max_in_flight: int = Field(32, ge=1, description="requests in flight at most")
    max_retries: int = Field(5, ge=0, description="retries of a failed request (5xx, 429, network)")
    backoff_seconds: float = Field(
        1.0, ge=0.0, description="first retry's wait; doubled at each retry"
    )
    timeout_seconds: float = Field(600.0, gt=0.0, description="per request")
    extra_body: dict[str, object] = Field(
        default_factory=dict, description="more request fields (server extensions), sent as they are"
    )


class GenerateRecipe(RecipeModel):
    """``hsstore generate RECIPE``: the target answers ``data``'s prompts into ``output``."""

    target: str = Field(description="local model directory or hub id (AutoModelForCausalLM)")
    data: list[str] = Field(min_length=1, description="JSONL / Parquet files or fsspec URLs")
    output: str = Field(description="the generated dataset's folder (created; resumed when rerun)")
    limit: int | None = Field(None, ge=1, description="read at most this many records (smoke runs)")
    allow_unfinished_generation: bool = Field(
        False,
        description="read a folder of hsstore generate whose run stopped early (cut by a time limit) "
        "as its committed units (a data folder of hsstore generate reads as its shards)",
    )
    backend: Literal["transformers", "openai"] = Field(
        "transformers",
        description="transformers: the target loaded here (executor picks where); "
        "openai: requests to openai.base_url",
    )
    executor: Literal["local", "ray"] = Field(
        "local", description="transformers backend: ray (one actor per GPU) or local (in process)"
    )
    model: ModelSection = Field(default_factory=ModelSection)
    prompting: PromptingSection = Field(default_factory=PromptingSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    batching: BatchingSection = Field(default_factory=BatchingSection)
    units: UnitsSection = Field(default_factory=UnitsSection)
    output_format: OutputSection = Field(default_factory=OutputSection)
    ray: RaySection = Field(default_factory=RaySection)
    openai: OpenAISection = Field(default_factory=OpenAISection)

    @field_validator("data", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _budget_holds_an_answer(self) -> GenerateRecipe:
        if self.batching.token_budget < self.sampling.max_new_tokens + 1:
            raise ValueError(
                f"batching.token_budget ({self.batching.token_budget}) must exceed "
                f"sampling.max_new_tokens ({self.sampling.max_new_tokens})"
            )
        return self
