"""The generation driver: read records into units, skip the committed ones, run the rest, commit.

Order of a run (each step a function of the recipe and the data, so reruns agree):

1. the target's identity, tokenizer and stop ids; the lineage; an existing output folder must
   have the same lineage (else refused, naming the field), so a rerun only resumes;
2. records are read in a stream and cut into units of ``units.max_records`` consecutive items
   (parse rejections included, so a unit's counts are the same on every run); units whose shard
   the manifest lists are skipped;
3. the executor (extraction's: in process, or Ray actors) runs the rest; as each unit comes back
   its shard is written and the manifest rewritten listing it (the commit point), so a SIGKILL
   loses only the units in flight; a SIGTERM or SIGINT (a scheduler's time limit, Ctrl-C) hands
   out no further unit, lets the units in flight finish and commit, and returns (a second signal
   stops at once);
4. the manifest is marked complete once every unit is committed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from hsstore.storage import StoreLocation
from pipelines.extract.lineage import CODE_VERSION
from pipelines.extract.planner import data_fingerprint
from pipelines.extract.records import iter_records
from pipelines.extract.target import resolve_target
from pipelines.generate.manifest import (
    MANIFEST_NAME,
    GenerationError,
    GenerationLineage,
    GenerationManifest,
    expand_generated_data,
    read_manifest,
    write_manifest,
)
from pipelines.generate.recipe import GenerateRecipe
from pipelines.generate.sink import write_unit
from pipelines.generate.summary import GenerationSummary
from pipelines.generate.worker import GenerationSpec, GenerationUnit, GenerationWorker, UnitOutput
from pipelines.stop_request import StopRequest
from pipelines.target_identity import (
    chat_template_sha256,
    read_config,
    target_identity,
    text_config,
    tokenizer_sha256,
)

logger = logging.getLogger(__name__)

CommitHook = Callable[[UnitOutput], None]


def run_generation(
    recipe: GenerateRecipe, *, progress: bool = False, on_commit: CommitHook | None = None
) -> GenerationSummary:
    """Run (or resume) the generation the recipe describes; ``on_commit`` runs after each commit.

    A data folder written by ``hsstore generate`` reads as its committed shards (every assistant
    turn written again: longer answers, another sampling or another target), and its lineage is
    kept in this dataset's."""
    from transformers import AutoTokenizer

    wall_start = time.perf_counter()
    files, source_generations = expand_generated_data(recipe.data, recipe.allow_unfinished_generation)
    if files != recipe.data:
        recipe = recipe.model_copy(update={"data": files})
    target_dir = resolve_target(recipe.target, recipe.model.revision)
    tokenizer_dir = recipe.prompting.tokenizer or target_dir
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_dir, trust_remote_code=recipe.model.trust_remote_code
    )
    config = text_config(read_config(target_dir))
    max_context = recipe.prompting.max_context or int(config.get("max_position_embeddings") or 4096)
    stop_ids = stop_token_ids(target_dir, tokenizer, recipe.sampling.stop_token_ids)
    lineage = build_lineage(recipe, target_dir, tokenizer_dir, tokenizer, max_context, stop_ids)
    lineage = lineage.model_copy(update={"source_generations": source_generations})
    location = StoreLocation(recipe.output)
    manifest = _reconcile(location, lineage, recipe)
    done = {shard.unit_index for shard in manifest.shards}
    summary = GenerationSummary(output=recipe.output)
    num_units = 0

    def todo() -> Iterator[GenerationUnit]:
        nonlocal num_units
        for unit in iter_units(recipe):
            num_units = unit.index + 1
            if unit.index in done:
                summary.num_units_skipped += 1
            else:
                yield unit

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    spec = GenerationSpec(
        recipe=recipe.model_dump(mode="json"),
        target_dir=target_dir,
        tokenizer_dir=tokenizer_dir,
        max_context=max_context,
        stop_token_ids=tuple(stop_ids),
        pad_token_id=int(pad),
        device=recipe.model.device,
    )
    pending = todo()
    first = next(pending, None)
    if first is not None:
        manifest = _run_units(
            recipe, spec, itertools.chain([first], pending), location, manifest, summary, progress, on_commit
        )
    if summary.stopped_by_signal is None:
        manifest = manifest.model_copy(update={"complete": True, "num_units": num_units})
        write_manifest(location, manifest)
        # What a killed earlier run was writing when it died (the units were written again since).
        for folder, name in (("", MANIFEST_NAME), ("shards", None), ("rejects", None)):
            location.remove_dead_atomic_writes(folder, name)
    summary.fill(manifest)
    summary.wall_seconds = time.perf_counter() - wall_start
    return summary


def iter_units(recipe: GenerateRecipe) -> Iterator[GenerationUnit]:
    """The input's units, in order: ``units.max_records`` consecutive items each."""
    items = iter_records(recipe.data, require_assistant=False)
    if recipe.limit is not None:
        items = itertools.islice(items, recipe.limit)
    for index in itertools.count():
        chunk = tuple(itertools.islice(items, recipe.units.max_records))
        if not chunk:
            return
        yield GenerationUnit(index=index, items=chunk)


def stop_token_ids(target_dir: str, tokenizer: Any, extra: list[int]) -> list[int]:
    """The target's EOS ids (generation_config.json, then the tokenizer's) plus the recipe's."""
    from transformers import GenerationConfig

    ids: list[int] = []
    try:
        eos = GenerationConfig.from_pretrained(target_dir).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    for value in (eos, tokenizer.eos_token_id, extra):
        if value is None:
            continue
        ids.extend(value if isinstance(value, list | tuple) else [value])
    if not ids:
        raise GenerationError(
            f"{target_dir}: no EOS id in generation_config.json nor the tokenizer; set "
            "sampling.stop_token_ids"
        )
    return sorted({int(i) for i in ids})


# How a sampled answer's tokens follow from its seed (engine.choose_next): one uniform number per
# token from the answer's CPU generator, through the token's cumulative distribution.
SAMPLER = "inverse-cdf"


def build_lineage(
    recipe: GenerateRecipe,
    target_dir: str,
    tokenizer_dir: str,
    tokenizer: Any,
    max_context: int,
    stop_ids: list[int],
) -> GenerationLineage:
    sampling = recipe.sampling.model_dump(mode="json")
    sampling["stop_token_ids"] = stop_ids
    if recipe.backend == "transformers" and recipe.sampling.temperature > 0:
        # The same seeds drew other answers before the batched sampler (engine.choose_next,
        # 2026-12-05): a folder sampled before it has no "sampler" and is not resumed by this one.
        sampling["sampler"] = SAMPLER
    identity = target_identity(target_dir)
    identity["name_or_path"] = recipe.target
    return GenerationLineage(
        target=identity,
        dtype=recipe.model.dtype if recipe.backend == "transformers" else None,
        backend=recipe.backend,
        served_model=(recipe.openai.model or recipe.target) if recipe.backend == "openai" else None,
        tokenizer_sha256=tokenizer_sha256(tokenizer_dir),
        chat_template_sha256=chat_template_sha256(getattr(tokenizer, "chat_template", None)),
        chat_template_kwargs=dict(recipe.prompting.chat_template_kwargs),
        sampling=sampling,
        text_prefix_tokens=recipe.prompting.text_prefix_tokens,
        max_context=max_context,
        source_fingerprint=data_fingerprint(recipe),  # type: ignore[arg-type] - reads data, limit
        code_version=CODE_VERSION,
    )


def _reconcile(
    location: StoreLocation, lineage: GenerationLineage, recipe: GenerateRecipe
) -> GenerationManifest:
    """The manifest to extend: a new one, or the folder's when its lineage and layout match."""
    manifest = read_manifest(location)
    if manifest is None:
        location.makedirs("")
        manifest = GenerationManifest(
            lineage=lineage,
            output_format=recipe.output_format.format,
            units_max_records=recipe.units.max_records,
        )
        write_manifest(location, manifest)
        return manifest
    ours, theirs = lineage.model_dump(mode="json"), manifest.lineage.model_dump(mode="json")
    ours["target"].pop("name_or_path", None)
    theirs["target"].pop("name_or_path", None)
    for key in sorted(ours):
        if ours[key] != theirs.get(key):
            raise GenerationError(
                f"{location.url} was generated with other settings: lineage field {key!r} differs "
                f"(folder: {str(theirs.get(key))[:120]}, recipe: {str(ours[key])[:120]}); a rerun "
                "resumes only the same recipe over the same data; write to a new output folder"
            )
    if manifest.units_max_records != recipe.units.max_records:
        raise GenerationError(
            f"{location.url} was cut into units of {manifest.units_max_records} records; this "
            f"recipe says units.max_records={recipe.units.max_records} (units would not line up)"
        )
    if manifest.output_format != recipe.output_format.format:
        raise GenerationError(
            f"{location.url} holds {manifest.output_format} shards; this recipe writes "
            f"{recipe.output_format.format}"
        )
    return manifest


def _make_executor(recipe: GenerateRecipe, spec: GenerationSpec) -> Any:
    if recipe.backend == "transformers" and recipe.executor == "ray":
        from pipelines.extract.executors import RayExecutor

        return RayExecutor(spec, recipe.ray, worker_class=GenerationWorker, job="generation")
    from pipelines.extract.executors import LocalExecutor

    return LocalExecutor(spec, worker_class=GenerationWorker)


def _run_units(
    recipe: GenerateRecipe,
    spec: GenerationSpec,
    todo: Iterator[GenerationUnit],
    location: StoreLocation,
    manifest: GenerationManifest,
    summary: GenerationSummary,
    progress: bool,
    on_commit: CommitHook | None,
) -> GenerationManifest:
    from tqdm.auto import tqdm

    executor = _make_executor(recipe, spec)
    summary.num_workers = len(getattr(executor, "actors", ())) or 1
    bar = tqdm(unit="tok", unit_scale=True, disable=not progress, desc="generate", smoothing=0.1)
    shown_uncommitted = 0
    state = {"manifest": manifest}

    def on_batch(num_answers: int, num_tokens: int) -> None:
        nonlocal shown_uncommitted
        shown_uncommitted += num_tokens
        bar.update(num_tokens)

    def on_result(output: UnitOutput) -> None:
        nonlocal shown_uncommitted
        shard = write_unit(
            location, output.unit_index, recipe.output_format.format, output.records, output.rejections, output.counts
        )
        current = state["manifest"]
        shards = [s for s in current.shards if s.unit_index != shard.unit_index] + [shard]
        state["manifest"] = current.model_copy(
            update={"shards": sorted(shards, key=lambda s: s.unit_index), "updated_at": _now()}
        )
        write_manifest(location, state["manifest"])  # the commit point
        summary.num_units_written += 1
        summary.new_tokens_this_run += shard.num_new_tokens
        # A line per commit: what a cluster job's log shows where there is no progress bar.
        elapsed = time.perf_counter() - start
        logger.info(
            "unit %d committed: %d answers, %d new tokens (%d records cut short); this run %d new tokens "
            "in %.0f s (%.0f tokens/s)", shard.unit_index, shard.num_answers, shard.num_new_tokens,
            shard.num_truncated, summary.new_tokens_this_run, elapsed, summary.new_tokens_this_run / max(elapsed, 1e-9),
        )
        shown = min(shown_uncommitted, shard.num_new_tokens)
        shown_uncommitted -= shown
        bar.update(shard.num_new_tokens - shown)
        bar.set_postfix(records=sum(s.num_written for s in state["manifest"].shards))
        if on_commit is not None:
            on_commit(output)

    def until_stopped(units: Iterator[GenerationUnit], stop: StopRequest) -> Iterator[GenerationUnit]:
        for unit in units:
            if stop.requested:
                return
            yield unit

    start = time.perf_counter()
    # After the executor has started: Ray's start installs handlers of its own.
    with StopRequest("committing the units in flight, then stopping (rerun to resume)") as stop:
        try:
            executor.run(until_stopped(todo, stop), on_result, on_batch)
        finally:
            summary.generate_seconds = time.perf_counter() - start
            bar.close()
            executor.close()
    summary.stopped_by_signal = stop.signum
    return state["manifest"]


def _now() -> str:
    from hsstore.manifest import now_iso

    return now_iso()
