"""The extraction driver: plan, skip what is committed, run the rest, commit unit by unit.

Order of a run (each step is a function of the recipe and the data, so reruns agree):

1. tokenizer, target config, features (:func:`prepare`; with Ray, on a thread while Ray starts);
2. lineage (:func:`open_lineage`): the target's weights and the data are hashed on a daemon
   thread; an existing store must have the same lineage (else refused, naming the field), so a
   rerun can only resume the same extraction: its other fields are checked at once, the hashes
   before planning; a new store is created with the complete lineage at the first commit;
3. on a fresh store the executor starts now (the actors loading the model, warming up eager and
   compiling in the background), while the hashes run and the first window is planned: the fast
   start (docs/extraction.md);
4. records are read, validated, tokenized and cut into units in a stream (planner.py), window by
   window as the executor asks for units; units whose shard id is already committed, or that
   belong to another partition rank, are skipped (:class:`UnitSchedule`);
5. the executor runs the rest; as each unit finishes its shard is committed (unit_runner.py);
6. every rejection, planning's and the worker's (rejects.py), goes to
   ``<store>/rejects/extract.jsonl`` and the summary; the last rank to finish removes dead shard
   attempts (:func:`finish`).

``dry_run`` stops after planning: every record read and tokenized, units cut and counted, and
neither the store nor the model touched. Planning imports no torch (tests/pipelines/extract/
test_planning_imports.py): the worker side is imported only when a unit is about to run.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hsstore import FeatureSpec, Lineage, committed_shard_ids
from hsstore.storage import StoreLocation
from pipelines.extract.batching import plan_batches
from pipelines.extract.executor_choice import resolve_executor
from pipelines.extract.lineage import (
    PendingLineage,
    aux_layer_ids_for,
    build_features,
    build_lineage,
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
from pipelines.extract.tokenizer_pool import make_sample_tokenizer
from pipelines.extract.unit_runner import CommitHook, UnitCommitter, make_executor, run_units
from pipelines.extract.units import WorkUnit, unit_shard_id
from pipelines.extract.worker_spec import WorkerSpec
from pipelines.generate.manifest import expand_generated_data
from pipelines.target_identity import read_config, text_config, weight_file_hashes, weight_files

__all__ = ["CommitHook", "run_extraction"]

logger = logging.getLogger(__name__)

# Planning rejections logged one by one; the rest are counted in one line (all are in the file).
LOGGED_REJECTIONS = 5


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
    wall_start, job_started_at, started_ray = time.perf_counter(), time.time(), False
    recipe = recipe.model_copy(update={"executor": resolve_executor(recipe.executor, recipe.ray)})
    try:
        if recipe.executor == "ray" and not dry_run:
            setup, started_ray = prepare_beside_ray(recipe)
        else:
            setup = prepare(recipe)
        summary = ExtractionSummary(store=setup.recipe.store, rejects_path="", dry_run=dry_run,
                                    executor=recipe.executor)
        summary.prepare_seconds = time.time() - job_started_at
        summary.feature_bytes_per_token = sum(f.raw_bytes_per_token for f in setup.features)
        if dry_run:
            plan_only(setup, summary)
        else:
            extract(setup, summary, progress=progress, on_commit=on_commit, job_started_at=job_started_at)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    summary.wall_seconds = time.perf_counter() - wall_start
    return summary


def prepare_beside_ray(recipe: ExtractRecipe) -> tuple[ExtractionSetup, bool]:
    """:func:`prepare` on a thread while Ray starts on this one (Ray sets its signal handlers
    from the thread that starts it): Ray's seconds of start-up beside the tokenizer's and the
    config's. Returns the setup and whether Ray was started here (then it is shut down here)."""
    import importlib.util

    from pipelines.extract.executors import start_ray

    if importlib.util.find_spec("ray") is None:  # the executor says so, after the recipe's checks
        return prepare(recipe), False
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare") as pool:
        preparing = pool.submit(prepare, recipe)
        started_ray = start_ray(recipe.ray)
        try:
            return preparing.result(), started_ray
        except BaseException:
            if started_ray:
                import ray

                ray.shutdown()
            raise


@dataclass(frozen=True)
class ExtractionSetup:
    """What the recipe resolves to before any record is read."""

    recipe: ExtractRecipe  # with ``hsstore generate`` folders expanded into their files
    target_dir: str  # the target as a local folder
    tokenizer_dir: str
    tokenizer: SampleTokenizer
    aux_layer_ids: list[int]
    features: list[FeatureSpec]
    # The lineage of each ``hsstore generate`` dataset among the inputs (who wrote the answers).
    generation_lineage: list[dict[str, Any]] = field(default_factory=list)


def prepare(recipe: ExtractRecipe) -> ExtractionSetup:
    """Resolve the data, the target and its tokenizer; the features follow from the target's config."""
    # A folder written by ``hsstore generate`` reads as its committed shards.
    files, generation_lineage = expand_generated_data(recipe.data, recipe.allow_unfinished_generation)
    if files != recipe.data:
        recipe = recipe.model_copy(update={"data": files})
    target_dir = resolve_target(recipe.target, recipe.model.revision)
    tokenizer_dir = recipe.tokenizer.path or target_dir
    tokenizer = make_sample_tokenizer(recipe, tokenizer_dir)
    config = text_config(read_config(target_dir))
    aux_layer_ids = aux_layer_ids_for(recipe, int(config["num_hidden_layers"]))
    features = build_features(recipe, len(aux_layer_ids), int(config["hidden_size"]))
    return ExtractionSetup(
        recipe=recipe,
        target_dir=target_dir,
        tokenizer_dir=tokenizer_dir,
        tokenizer=tokenizer,
        aux_layer_ids=aux_layer_ids,
        features=features,
        generation_lineage=generation_lineage,
    )


def plan_only(setup: ExtractionSetup, summary: ExtractionSummary) -> None:
    """--dry-run: every window planned and counted (padding too), nothing kept, nothing written."""
    batching = setup.recipe.batching
    planner = StreamPlanner(setup.recipe, setup.tokenizer, setup.tokenizer_dir)
    for window in planner.windows():
        count_window(summary, window)
        for unit in window.units:
            for batch in plan_batches(
                [len(r.input_ids) for r in unit.rows],
                batching.token_budget,
                max_batch_size=batching.max_batch_size,
                pad_to_multiple_of=batching.pad_to_multiple_of,
            ):
                summary.num_padded_tokens += batch.num_padded_tokens
        summary.num_tokens_written += window.num_tokens  # planned: what padding_waste compares


def extract(
    setup: ExtractionSetup,
    summary: ExtractionSummary,
    *,
    progress: bool,
    on_commit: CommitHook | None,
    job_started_at: float | None = None,
) -> None:
    """Plan in a stream and run every unit of this partition rank that is not committed yet.

    ``job_started_at`` (time.time()): when the job started, for the summary's start-up timings."""
    recipe = setup.recipe
    location = StoreLocation(recipe.store, recipe.storage_options)
    summary.rejects_path = location.path(REJECTS_PATH)
    job_started_at = time.time() if job_started_at is None else job_started_at
    lineage = open_lineage(setup, location)
    committed = committed_shard_ids(location)
    spec = WorkerSpec.from_recipe(
        recipe,
        target_dir=setup.target_dir,
        features=setup.features,
        aux_layer_ids=setup.aux_layer_ids,
        pad_token_id=pad_token_id(setup.tokenizer),
    )
    # A fresh store: the workers start (Ray, the model loaded, the warm-up) while the lineage is
    # hashed and the first window planned. A resume plans first: every unit may be committed
    # already, and loading the target on every GPU to find that out would be waste.
    executor = start_executor(recipe, spec, summary) if not committed else None
    try:
        if lineage.store_exists:
            lineage.get()  # other weights or data: refused before planning or any compute
        planner = StreamPlanner(
            recipe, setup.tokenizer, setup.tokenizer_dir, journal=PlanJournal(location), committed=committed
        )
        schedule = UnitSchedule(planner, recipe, committed, summary)
        todo = schedule.units()
        first = next(todo, None)  # plans up to the first unit to run (all of it on a full resume)
        summary.first_unit_planned_seconds = time.time() - job_started_at
        if first is not None:
            executor = executor or start_executor(recipe, spec, summary)
            committer = UnitCommitter(
                location, setup.features, lineage, summary, UnitRejects(location), on_commit
            )
            run_units(executor, itertools.chain([first], todo), committer, progress, job_started_at)
    except Exception:
        lineage.settle_after_failure()
        raise
    finally:
        if executor is not None:
            executor.close()
    lineage.get()  # nothing committed (every record rejected): the store still gets its lineage
    summary.fingerprint_seconds = lineage.hash_seconds
    summary.lineage_wait_seconds = lineage.wait_seconds
    _log_outcome(summary, schedule)
    finish(location, schedule, summary)


def start_executor(recipe: ExtractRecipe, spec: WorkerSpec, summary: ExtractionSummary) -> Any:
    """make_executor, timed: Ray's start and the actors asked for (they load in the background)."""
    start = time.perf_counter()
    executor = make_executor(recipe, spec)
    summary.executor_start_seconds = time.perf_counter() - start
    return executor


def open_lineage(setup: ExtractionSetup, location: StoreLocation) -> PendingLineage:
    """The store's lineage, its slow parts (the weight hashes, the data fingerprint) computed in
    the background; an existing store is checked at once on every other field."""
    recipe = setup.recipe

    def build(weights_sha256: dict[str, str], data_sha256: str) -> Lineage:
        return build_lineage(
            recipe,
            setup.target_dir,
            setup.tokenizer_dir,
            setup.tokenizer,
            setup.aux_layer_ids,
            data_sha256,
            generation=setup.generation_lineage or None,
            weights_sha256=weights_sha256,
        )

    weight_files(setup.target_dir)  # no weights at all: said now, not after the workers start

    def fingerprints() -> tuple[dict[str, str], str]:
        return weight_file_hashes(setup.target_dir), data_fingerprint(recipe)

    return PendingLineage(location, setup.features, build, fingerprints)


def pad_token_id(tokenizer: SampleTokenizer) -> int:
    """The tokenizer's pad token, else its end-of-sequence token, else 0 (never attended to)."""
    pad = tokenizer.tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.tokenizer.eos_token_id or 0
    return int(pad)


class UnitSchedule:
    """The units this run extracts, planned window by window as the executor asks for them: this
    partition rank's units whose shards are not committed yet. Counts every window into the
    summary and keeps planning's rejections and every unit's index on the way."""

    def __init__(
        self,
        planner: StreamPlanner,
        recipe: ExtractRecipe,
        committed: set[str],
        summary: ExtractionSummary,
    ):
        self.planner = planner
        self.partition = recipe.partition
        self.committed = committed
        self.summary = summary
        self.planning_rejections: list[Rejection] = []
        self.all_units: list[int] = []  # indices: every unit of the plan (ints, not the units)

    def units(self) -> Iterator[WorkUnit]:
        for window in self.planner.windows():
            count_window(self.summary, window)
            for rejection in window.rejections:
                self.planning_rejections.append(rejection)
                if len(self.planning_rejections) <= LOGGED_REJECTIONS:
                    logger.warning("rejected (%s) %s", rejection.reason, rejection.message)
            indices = range(window.first_unit, window.first_unit + window.num_units)
            self.all_units.extend(indices)
            mine = {i for i in indices if i % self.partition.world_size == self.partition.rank}
            self.summary.num_units_skipped += sum(unit_shard_id(i) in self.committed for i in mine)
            if window.from_journal:
                continue  # every unit committed: nothing to run, nothing was tokenized
            yield from (u for u in window.units if u.index in mine and u.shard_id not in self.committed)


def count_window(summary: ExtractionSummary, window: WindowPlan) -> None:
    summary.num_records += window.num_records
    summary.num_samples += window.num_samples
    summary.num_tokens += window.num_tokens
    summary.num_loss_tokens += window.num_loss_tokens
    summary.num_truncated += window.num_truncated
    summary.num_units += window.num_units
    reasons: Counter[str] = Counter(summary.rejected)
    reasons.update(str(r.reason) for r in window.rejections)
    summary.rejected = dict(sorted(reasons.items()))


def _log_outcome(summary: ExtractionSummary, schedule: UnitSchedule) -> None:
    if summary.num_units_skipped:
        logger.info(
            "resumed: %d of %d units were already committed", summary.num_units_skipped, summary.num_units
        )
    if not summary.num_samples:
        logger.warning("no sample was accepted from %d records; nothing to extract", summary.num_records)
    unlogged = len(schedule.planning_rejections) - LOGGED_REJECTIONS
    if unlogged > 0:
        logger.warning("... %d more rejections in %s", unlogged, summary.rejects_path)


def finish(location: StoreLocation, schedule: UnitSchedule, summary: ExtractionSummary) -> None:
    """Every rejection to the rejects file and the summary; dead attempts removed once every unit
    (every rank's) is committed; the store's size."""
    from hsstore.commit import read_manifest
    from hsstore.gc import collect_garbage

    # Other ranks (partition.world_size > 1) may still be writing: their attempt folders and
    # manifest temp files are not garbage until every unit is committed.
    committed = committed_shard_ids(location)
    pending_elsewhere = [i for i in schedule.all_units if unit_shard_id(i) not in committed]
    summary.num_units_elsewhere = len(pending_elsewhere)
    # Every unit's worker rejections (this run's, earlier runs', other ranks'), from disk.
    unit_rejects = UnitRejects(location)
    unit_rejects.load([i for i in schedule.all_units if unit_shard_id(i) in committed])
    count_worker_rejections(summary, unit_rejects)
    write_rejects(location, schedule.planning_rejections + unit_rejects.rejections())

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


def remove_dead_temp_files(location: StoreLocation) -> list[str]:
    """Temp files of atomic writes that a killed process never renamed: the manifest's (at the
    top level) and the rejects files'. Called only when every unit is committed, so no commit of
    this extraction is in flight; returns what was removed."""
    from hsstore.manifest import MANIFEST_NAME

    removed = location.remove_dead_atomic_writes("", MANIFEST_NAME)
    for folder in ("rejects", UNIT_REJECTS_DIR):
        removed += location.remove_dead_atomic_writes(folder)
    return removed
