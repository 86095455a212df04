"""The extraction driver: plan, skip what is committed, run the rest, commit unit by unit.

Order of a run (each step is a function of the recipe and the data, so reruns agree):

1. tokenizer and target identity; read, validate and tokenize every record (rejections counted
   by reason, written to ``<store>/rejects/extract.jsonl``);
2. features and lineage; an existing store must have the same lineage (else refused, naming the
   field), so a rerun can only resume the same extraction;
3. cut the accepted samples into units; units whose shard id is already committed are skipped;
4. the executor runs the rest; as each unit finishes its shard is committed (the manifest is the
   commit point), so a crash loses only the units in flight;
5. records the target raised on (``worker_error``, left out of their unit by the worker) join the
   rejects file and the summary. Each unit's are saved under ``rejects/units/`` before its commit,
   so a resume that skips a committed unit still reports them: a rerun gives the same rejects.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hsstore import commit_shards, committed_shard_ids, ensure_store
from hsstore.storage import StoreLocation
from pipelines.extract.lineage import (
    aux_layer_ids_for,
    build_features,
    build_lineage,
    reconcile_lineage,
)
from pipelines.extract.planner import PlanJournal, StreamPlanner, WindowPlan, data_fingerprint
from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.records import Rejection
from pipelines.extract.rejects import (
    REJECTS_PATH,
    UNIT_REJECTS_DIR,
    UnitRejects,
    count_worker_rejections,
    write_rejects,
)
from pipelines.extract.summary import ExtractionSummary
from pipelines.extract.target import resolve_target
from pipelines.extract.tokenize import SampleTokenizer
from pipelines.extract.tokenizer_pool import load_tokenizer, make_sample_tokenizer
from pipelines.generate.manifest import expand_generated_data

__all__ = ["load_tokenizer", "make_sample_tokenizer", "run_extraction"]  # the tokenizer: re-exported
from pipelines.extract.units import UnitResult, WorkUnit, unit_shard_id
from pipelines.extract.worker_spec import WorkerSpec
from pipelines.target_identity import (
    read_config,
    text_config,
)

logger = logging.getLogger(__name__)

CommitHook = Callable[[UnitResult, Any], None]


def run_extraction(
    recipe: ExtractRecipe,
    *,
    progress: bool = False,
    on_commit: CommitHook | None = None,
    dry_run: bool = False,
) -> ExtractionSummary:
    """Run (or resume) the extraction the recipe describes and return its summary.

    ``progress`` shows a tqdm bar (samples, tokens, tokens/s). ``on_commit(result, executor)`` is
    called after each unit's commit (tests use it to inject faults). ``dry_run`` plans only: reads
    and tokenizes every record, cuts the units, counts, and touches neither the store nor the model.
    """
    wall_start = time.perf_counter()
    # A folder written by ``hsstore generate`` reads as its committed shards; its lineage (who
    # wrote the answers) goes into the store's.
    data_files, generation_lineage = expand_generated_data(recipe.data)
    if data_files != recipe.data:
        recipe = recipe.model_copy(update={"data": data_files})
    target_dir = resolve_target(recipe.target, recipe.model.revision)
    tokenizer_dir = recipe.tokenizer.path or target_dir
    sample_tokenizer = make_sample_tokenizer(recipe, tokenizer_dir)
    summary = ExtractionSummary(store=recipe.store, rejects_path="", dry_run=dry_run)
    config = text_config(read_config(target_dir))
    aux_layer_ids = aux_layer_ids_for(recipe, int(config["num_hidden_layers"]))
    features = build_features(recipe, len(aux_layer_ids), int(config["hidden_size"]))
    summary.feature_bytes_per_token = sum(f.raw_bytes_per_token for f in features)
    if dry_run:
        _plan_only(recipe, sample_tokenizer, tokenizer_dir, summary)
        summary.wall_seconds = time.perf_counter() - wall_start
        return summary

    location = StoreLocation(recipe.store, recipe.storage_options)
    summary.rejects_path = location.path(REJECTS_PATH)
    lineage = build_lineage(
        recipe,
        target_dir,
        tokenizer_dir,
        sample_tokenizer,
        aux_layer_ids,
        data_fingerprint(recipe),
        generation=generation_lineage or None,
    )
    lineage = reconcile_lineage(location, lineage)
    ensure_store(location, features=features, lineage=lineage)
    done = committed_shard_ids(location)
    planner = StreamPlanner(
        recipe, sample_tokenizer, tokenizer_dir, journal=PlanJournal(location), committed=done
    )
    part = recipe.partition
    planning_rejections: list[Rejection] = []
    all_units: list[int] = []  # indices: every unit of the plan (ints, not the units)

    def todo_units() -> Iterator[WorkUnit]:
        """The units this run extracts, planned window by window as the executor asks for them."""
        for window in planner.windows():
            _count_window(summary, window)
            planning_rejections.extend(window.rejections)
            for rejection in window.rejections:
                if len(planning_rejections) <= 5:
                    logger.warning("rejected (%s) %s", rejection.reason, rejection.message)
            units = range(window.first_unit, window.first_unit + window.num_units)
            all_units.extend(units)
            mine = [i for i in units if i % part.world_size == part.rank]
            skipped = [i for i in mine if unit_shard_id(i) in done]
            summary.num_units_skipped += len(skipped)
            if window.from_journal:
                continue  # every unit committed: nothing to run, nothing was tokenized
            yield from (u for u in window.units if u.index in mine and u.shard_id not in done)

    unit_rejects = UnitRejects(location)
    todo = todo_units()
    first = next(todo, None)  # plans up to the first unit to run (all of it on a full resume)
    if first is not None:
        pad_token_id = sample_tokenizer.tokenizer.pad_token_id
        if pad_token_id is None:
            pad_token_id = sample_tokenizer.tokenizer.eos_token_id or 0
        spec = WorkerSpec(
            target=target_dir,
            store=recipe.store,
            storage_options=dict(recipe.storage_options),
            features=tuple(features),
            aux_layer_ids=tuple(aux_layer_ids),
            final_hidden_state=recipe.capture.final_hidden_state,
            topk_k=recipe.capture.topk_k if recipe.capture.target_distribution == "topk" else None,
            topk_chunk_tokens=recipe.capture.topk_chunk_tokens,
            dtype=recipe.model.dtype,
            device=recipe.model.device,
            attn_implementation=recipe.model.attn_implementation,
            trust_remote_code=recipe.model.trust_remote_code,
            token_budget=recipe.batching.token_budget,
            max_batch_size=recipe.batching.max_batch_size,
            max_length=recipe.batching.max_length,
            pad_to_multiple_of=recipe.batching.pad_to_multiple_of,
            pass_attention_mask=recipe.batching.pass_attention_mask,
            pad_token_id=int(pad_token_id),
            profile_dir=recipe.profiler.dir,
            profile_batches=recipe.profiler.batches,
        )
        _run_units(
            recipe,
            spec,
            itertools.chain([first], todo),
            features,
            lineage,
            location,
            summary,
            progress,
            on_commit,
            unit_rejects,
        )
    if summary.num_units_skipped:
        logger.info(
            "resumed: %d of %d units were already committed", summary.num_units_skipped, summary.num_units
        )
    if not summary.num_samples:
        logger.warning("no sample was accepted from %d records; nothing to extract", summary.num_records)
    if len(planning_rejections) > 5:
        logger.warning("... %d more rejections in %s", len(planning_rejections) - 5, summary.rejects_path)

    from hsstore.commit import read_manifest
    from hsstore.gc import collect_garbage

    # Other ranks (partition.world_size > 1) may still be writing: their attempt folders and
    # manifest temp files are not garbage until every unit is committed.
    committed = committed_shard_ids(location)
    pending_elsewhere = [i for i in all_units if unit_shard_id(i) not in committed]
    summary.num_units_elsewhere = len(pending_elsewhere)
    # Every unit's worker rejections (this run's, earlier runs', other ranks'), from disk.
    unit_rejects = UnitRejects(location)
    unit_rejects.load([i for i in all_units if unit_shard_id(i) in committed])
    count_worker_rejections(summary, unit_rejects)
    write_rejects(location, planning_rejections + unit_rejects.rejections())

    if pending_elsewhere:
        logger.info(
            "%d unit(s) of other partition ranks are not committed yet; the last rank to finish "
            "cleans up and writes the complete rejects file",
            len(pending_elsewhere),
        )
    else:
        # Every unit is committed now, so any other shard folder is a dead attempt (a killed
        # worker or driver, a retried unit): remove it, so that a finished run leaves a store
        # that verifies without findings.
        removed = collect_garbage(location, min_age_s=0.0) + remove_dead_temp_files(location)
        if removed:
            logger.info(
                "removed %d dead shard attempt(s) left by earlier crashes or retries", len(removed)
            )
    manifest = read_manifest(location)
    summary.store_bytes = manifest.num_bytes if manifest else 0
    summary.wall_seconds = time.perf_counter() - wall_start
    return summary


def _count_window(summary: ExtractionSummary, window: WindowPlan) -> None:
    summary.num_records += window.num_records
    summary.num_samples += window.num_samples
    summary.num_tokens += window.num_tokens
    summary.num_loss_tokens += window.num_loss_tokens
    summary.num_truncated += window.num_truncated
    summary.num_units += window.num_units
    reasons: Counter[str] = Counter(summary.rejected)
    reasons.update(str(r.reason) for r in window.rejections)
    summary.rejected = dict(sorted(reasons.items()))


def _plan_only(
    recipe: ExtractRecipe, tokenizer: SampleTokenizer, tokenizer_dir: str, summary: ExtractionSummary
) -> None:
    """--dry-run: every window planned and counted (padding too), nothing kept, nothing written."""
    from pipelines.extract.batching import plan_batches

    planner = StreamPlanner(recipe, tokenizer, tokenizer_dir)
    for window in planner.windows():
        _count_window(summary, window)
        for unit in window.units:
            for batch in plan_batches(
                [len(r.input_ids) for r in unit.rows],
                recipe.batching.token_budget,
                max_batch_size=recipe.batching.max_batch_size,
                pad_to_multiple_of=recipe.batching.pad_to_multiple_of,
            ):
                summary.num_padded_tokens += batch.num_padded_tokens
        summary.num_tokens_written += window.num_tokens  # planned: what padding_waste compares


@dataclass
class _TimelineMarks:
    """Wall-clock marks (time.time()) over the units' results, for the summary's head and tail."""

    first_forward: float = math.inf  # the host starting the first unit's forwards
    last_forward: float = 0.0  # the host done with the last unit's forwards
    last_landed: float = 0.0  # the last batch's features on the host
    gpu_first_forward: float = math.inf  # on a GPU (CUDA events; not known on a CPU)
    gpu_last_forward: float = 0.0

    def add(self, result: UnitResult) -> None:
        self.first_forward = min(self.first_forward, result.compute_started_at)
        self.last_forward = max(self.last_forward, result.compute_ended_at)
        self.last_landed = max(self.last_landed, result.landed_at)
        if result.gpu_started_at:
            self.gpu_first_forward = min(self.gpu_first_forward, result.gpu_started_at)
            self.gpu_last_forward = max(self.gpu_last_forward, result.gpu_ended_at)

    def fill(self, summary: ExtractionSummary, started_at: float, ended_at: float) -> None:
        if not self.last_forward:  # no unit ran
            return
        summary.head_seconds = max(0.0, self.first_forward - started_at)
        summary.tail_seconds = max(0.0, ended_at - self.last_forward)
        if self.last_landed:
            summary.tail_after_landed_seconds = max(0.0, ended_at - self.last_landed)
        if self.gpu_last_forward:
            summary.gpu_head_seconds = max(0.0, self.gpu_first_forward - started_at)
            summary.gpu_tail_seconds = max(0.0, ended_at - self.gpu_last_forward)


def _run_units(
    recipe: ExtractRecipe,
    spec: WorkerSpec,
    todo: Iterator[WorkUnit],
    features: list[Any],
    lineage: Any,
    location: StoreLocation,
    summary: ExtractionSummary,
    progress: bool,
    on_commit: CommitHook | None,
    unit_rejects: UnitRejects,
) -> None:
    from tqdm.auto import tqdm

    if recipe.executor == "ray":
        from pipelines.extract.executors import RayExecutor

        executor: Any = RayExecutor(spec, recipe.ray)
    else:
        from pipelines.extract.executors import LocalExecutor

        executor = LocalExecutor(spec)
    summary.num_workers = len(getattr(executor, "actors", ())) or 1
    bar = tqdm(
        total=None,  # planned in a stream: the total is known only at the end
        unit="tok",
        unit_scale=True,
        disable=not progress,
        desc="extract",
        smoothing=0.1,
    )
    start = time.perf_counter()
    started_at = time.time()
    marks = _TimelineMarks()
    units_done = summary.num_units_skipped
    todo_by_index: dict[int, WorkUnit] = {}  # handed out, not yet committed

    def handed_out() -> Iterator[WorkUnit]:
        for unit in todo:
            todo_by_index[unit.index] = unit
            yield unit

    # Tokens the bar has shown but no committed unit holds yet (per-batch progress, in process).
    shown_uncommitted = 0

    def on_batch(num_samples: int, num_tokens: int) -> None:
        nonlocal shown_uncommitted
        shown_uncommitted += num_tokens
        bar.update(num_tokens)

    def on_result(result: UnitResult) -> None:
        nonlocal units_done, shown_uncommitted
        # Saved before the commit: a committed unit always has its rejections on disk.
        unit_rejects.save(result, todo_by_index.pop(result.unit_index))
        commit_shards(location, [result.record], features=features, lineage=lineage)
        units_done += 1
        summary.num_samples_written += result.num_samples
        summary.num_tokens_written += result.num_tokens
        summary.num_padded_tokens += result.num_padded_tokens
        summary.writer_busy_seconds += result.write_seconds
        summary.copy_wait_seconds += result.copy_wait_seconds
        summary.compute_seconds += result.compute_seconds
        summary.pool_wait_seconds += result.pool_wait_seconds
        summary.gpu_forward_seconds += result.gpu_forward_seconds
        summary.gpu_between_seconds += result.gpu_between_seconds
        marks.add(result)
        already_shown = min(shown_uncommitted, result.num_tokens)
        shown_uncommitted -= already_shown
        bar.update(result.num_tokens - already_shown)
        bar.set_postfix(
            samples=summary.num_samples_written,
            units=f"{units_done}/{summary.num_units}+",
        )
        if on_commit is not None:
            on_commit(result, executor)

    try:
        executor.run(handed_out(), on_result, on_batch)
    finally:
        summary.extract_seconds = time.perf_counter() - start
        marks.fill(summary, started_at, time.time())
        bar.close()
        executor.close()


def remove_dead_temp_files(location: StoreLocation) -> list[str]:
    """Temp files of atomic writes that a killed process never renamed: the manifest's (at the
    top level) and the rejects file's. Called only when every unit is committed, so no commit of
    this extraction is in flight; returns what was removed."""
    from hsstore.manifest import MANIFEST_NAME

    removed = []
    for folder in ("", "rejects", UNIT_REJECTS_DIR):
        if folder and not location.exists(folder):
            continue
        for name in location.list_dir(folder):
            is_temp = name.endswith(".tmp") and name.startswith(
                f".{MANIFEST_NAME}." if not folder else "."
            )
            if is_temp:
                relative = f"{folder}/{name}" if folder else name
                location.delete(relative)
                removed.append(relative)
    return removed
