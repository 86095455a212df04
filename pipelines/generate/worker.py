"""The generation worker: one unit of records in, its output records and rejections out.

The same class runs in process (``executor: local``, and every ``backend: openai`` run) and inside
the Ray actors (one per GPU), through extraction's executors (pipelines/extract/executors.py).
Unlike extraction's worker it writes nothing: a unit's output is a few hundred KB of text, which
comes back to the driver, and the driver commits it. Each unit's turns are generated in rounds:
round r answers the r-th assistant turn of every record that has one, so a record's later turns
see its earlier answers while the answers of one round share batches.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pipelines.extract.records import Record, Rejection, RejectReason
from pipelines.generate.manifest import GenerationError
from pipelines.generate.prompts import FINISH_STOP, PromptBuilder, RecordJob, Request
from pipelines.generate.recipe import GenerateRecipe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationSpec:
    """What a worker needs, picklable for Ray; ``device`` and ``num_gpus`` are set per actor."""

    recipe: dict[str, Any]  # GenerateRecipe.model_dump(mode="json")
    target_dir: str
    tokenizer_dir: str
    max_context: int
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    device: str = "auto"
    num_gpus: int = 1


@dataclass(frozen=True)
class GenerationUnit:
    """Consecutive input items (records, or their parse rejections), written as one shard."""

    index: int
    items: tuple[Record | Rejection, ...]

    @property
    def shard_id(self) -> str:
        return f"u{self.index:06d}"


@dataclass
class UnitOutput:
    """A finished unit: output records in input order, rejections, counts."""

    unit_index: int
    records: list[dict[str, Any]] = field(default_factory=list)
    rejections: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class GenerationWorker:
    """Loads the backend once (the target, or the endpoint's client) and answers units."""

    def __init__(self, spec: GenerationSpec) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        self.recipe = GenerateRecipe.model_validate(spec.recipe)
        recipe = self.recipe
        self.tokenizer = AutoTokenizer.from_pretrained(
            spec.tokenizer_dir, trust_remote_code=recipe.model.trust_remote_code
        )
        self.builder = PromptBuilder(
            self.tokenizer,
            text_prefix_tokens=recipe.prompting.text_prefix_tokens,
            max_context=spec.max_context,
            max_new_tokens=recipe.sampling.max_new_tokens,
            seed=recipe.sampling.seed,
            chat_template_kwargs=recipe.prompting.chat_template_kwargs,
        )
        # One unit computes at a time: the executor keeps a second one queued, not competing.
        self._compute_lock = threading.Lock()
        self.backend: Any = self._openai() if recipe.backend == "openai" else self._transformers()

    def _openai(self) -> Any:
        from pipelines.generate.openai_backend import OpenAIGenerator

        self._compute_lock = _NoLock()  # requests in flight overlap across units
        return OpenAIGenerator(
            self.recipe.openai,
            self.recipe.sampling,
            self.recipe.target,
            self.tokenizer,
            self.recipe.prompting.chat_template_kwargs,
        )

    def _transformers(self) -> Any:
        from pipelines.extract.target import load_target, resolve_device
        from pipelines.generate.engine import BatchGenerator, SamplingParams

        if self.spec.num_gpus > 1:
            raise GenerationError(
                "ray.num_gpus_per_worker > 1: a generation actor holds the target on one GPU; "
                "serve larger targets with vLLM or SGLang and use backend: openai"
            )
        recipe = self.recipe
        device = resolve_device(self.spec.device if self.spec.device != "auto" else recipe.model.device)
        model = load_target(
            self.spec.target_dir,
            dtype=recipe.model.dtype,
            device=device,
            attn_implementation=recipe.model.attn_implementation,
            trust_remote_code=recipe.model.trust_remote_code,
        )
        return BatchGenerator(
            model,
            self.tokenizer,
            stop_token_ids=self.spec.stop_token_ids,
            pad_token_id=self.spec.pad_token_id,
            params=SamplingParams(
                temperature=recipe.sampling.temperature,
                top_p=recipe.sampling.top_p,
                top_k=recipe.sampling.top_k,
            ),
            max_batch_size=recipe.batching.max_batch_size,
            token_budget=recipe.batching.token_budget,
            max_padding_share=recipe.batching.max_padding_share,
        )

    def run_unit(self, unit: GenerationUnit, on_batch: Any = None) -> UnitOutput:
        with self._compute_lock:
            start = time.perf_counter()
            output = self._run(unit, on_batch)
            output.seconds = time.perf_counter() - start
            return output

    def _run(self, unit: GenerationUnit, on_batch: Any) -> UnitOutput:
        rejected: dict[int, Rejection] = {}
        jobs: dict[int, RecordJob] = {}
        for position, item in enumerate(unit.items):
            started = item if isinstance(item, Rejection) else self.builder.start(item)
            if isinstance(started, Rejection):
                rejected[position] = started
            else:
                jobs[position] = started
        active = sorted(jobs)
        while active:
            asked: list[tuple[int, Request]] = []
            for position in active:
                request = self.builder.request(jobs[position])
                if isinstance(request, Rejection):
                    rejected[position] = request
                else:
                    asked.append((position, request))
            answers = self.backend.generate([r for _, r in asked], on_batch)
            for (position, request), answer in zip(asked, answers, strict=True):
                if answer.error is not None:
                    job = jobs[position]
                    rejected[position] = Rejection(
                        RejectReason.GENERATION_ERROR,
                        f"{job.record.origin}: {answer.error}",
                        job.record.origin,
                        job.record.source_id,
                    )
                else:
                    self.builder.accept(jobs[position], request, answer)
            active = [p for p, _ in asked if p not in rejected and not jobs[p].done]
        written = [jobs[p] for p in sorted(jobs) if p not in rejected]
        return UnitOutput(
            unit_index=unit.index,
            records=[job.to_output() for job in written],
            rejections=[rejected[p].to_json() for p in sorted(rejected)],
            counts={
                "num_answers": sum(len(j.finish_reasons) for j in written),
                "num_new_tokens": sum(j.num_new_tokens for j in written),
                "num_truncated": sum(any(r != FINISH_STOP for r in j.finish_reasons) for j in written),
            },
        )

    def close(self) -> None:
        closer = getattr(self.backend, "close", None)
        if closer is not None:
            closer()


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
