"""Running the planned units: the executor runs them, and each finished unit is committed at once.

The manifest is the commit point, so a crash loses only the units in flight. A unit's worker
rejections are saved before its commit (rejects.UnitRejects), so a committed unit always has them
on disk. The summary gathers each result's counts and timings as it is committed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hsstore import FeatureSpec, commit_shards
from hsstore.storage import StoreLocation
from pipelines.extract.lineage import PendingLineage
from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.rejects import UnitRejects
from pipelines.extract.summary import ExtractionSummary
from pipelines.extract.units import UnitResult, WorkUnit
from pipelines.extract.worker_spec import WorkerSpec

CommitHook = Callable[[UnitResult, Any], None]


def make_executor(recipe: ExtractRecipe, spec: WorkerSpec) -> Any:
    """Ray actors or one worker in process, as the recipe says (imported here: they load torch)."""
    if recipe.executor == "ray":
        from pipelines.extract.executors import RayExecutor

        return RayExecutor(spec, recipe.ray)
    from pipelines.extract.executors import LocalExecutor

    return LocalExecutor(spec)


def run_units(
    executor: Any,
    todo: Iterator[WorkUnit],
    committer: UnitCommitter,
    progress: bool,
    job_started_at: float,
) -> None:
    """Run ``todo`` on ``executor`` (make_executor's, started already: its workers may still be
    loading the model), committing each unit as it finishes. The caller closes the executor.

    ``extract_seconds`` counts from the workers being ready (models loaded and warmed up) to the
    last commit, as before the workers started in the background; the start-up is in its own
    fields (``workers_ready_seconds``, ``first_forward_seconds`` from ``job_started_at``)."""
    from tqdm.auto import tqdm

    summary = committer.summary
    startups = [s for s in executor.wait_ready() if s is not None]
    summary.record_startup(startups, job_started_at)
    summary.num_workers = len(getattr(executor, "actors", ())) or 1
    committer.executor = executor
    committer.bar = tqdm(
        total=None,  # planned in a stream: the total is known only at the end
        unit="tok",
        unit_scale=True,
        disable=not progress,
        desc="extract",
        smoothing=0.1,
    )
    start = time.perf_counter()
    started_at = time.time()
    try:
        executor.run(committer.handed_out(todo), committer.on_result, committer.on_batch)
    finally:
        summary.extract_seconds = time.perf_counter() - start
        summary.units_by_node = dict(getattr(executor, "units_by_node", {}))
        committer.marks.fill(summary, started_at, time.time(), job_started_at)
        committer.bar.close()


class UnitCommitter:
    """Commits each finished unit and keeps the summary and the progress bar up to date."""

    def __init__(
        self,
        location: StoreLocation,
        features: Sequence[FeatureSpec],
        lineage: PendingLineage,
        summary: ExtractionSummary,
        unit_rejects: UnitRejects,
        on_commit: CommitHook | None = None,
    ):
        self.location = location
        self.features = list(features)
        self.lineage = lineage  # complete at the first commit (its hashes run in the background)
        self.summary = summary
        self.unit_rejects = unit_rejects
        self.on_commit = on_commit
        self.executor: Any = None  # set by run_units: on_commit receives it
        self.bar: Any = None
        self.marks = TimelineMarks()
        self.units_done = summary.num_units_skipped
        self.in_flight: dict[int, WorkUnit] = {}  # handed out, not yet committed
        # Tokens the bar has shown but no committed unit holds yet (per-batch progress, in process).
        self.shown_uncommitted = 0

    def handed_out(self, todo: Iterator[WorkUnit]) -> Iterator[WorkUnit]:
        """``todo``, remembering each unit until its result comes back (its rejections need it)."""
        for unit in todo:
            self.in_flight[unit.index] = unit
            yield unit

    def on_batch(self, num_samples: int, num_tokens: int) -> None:
        self.shown_uncommitted += num_tokens
        self.bar.update(num_tokens)

    def on_result(self, result: UnitResult) -> None:
        # Saved before the commit: a committed unit always has its rejections on disk.
        self.unit_rejects.save(result, self.in_flight.pop(result.unit_index))
        lineage = self.lineage.get()  # the first commit waits for the hashes and creates the store
        commit_shards(self.location, [result.record], features=self.features, lineage=lineage)
        self.units_done += 1
        self._count(result)
        already_shown = min(self.shown_uncommitted, result.num_tokens)
        self.shown_uncommitted -= already_shown
        self.bar.update(result.num_tokens - already_shown)
        self.bar.set_postfix(
            samples=self.summary.num_samples_written,
            units=f"{self.units_done}/{self.summary.num_units}+",
        )
        if self.on_commit is not None:
            self.on_commit(result, self.executor)

    def _count(self, result: UnitResult) -> None:
        summary = self.summary
        summary.num_samples_written += result.num_samples
        summary.num_tokens_written += result.num_tokens
        summary.num_padded_tokens += result.num_padded_tokens
        summary.writer_busy_seconds += result.write_seconds
        summary.copy_wait_seconds += result.copy_wait_seconds
        summary.compute_seconds += result.compute_seconds
        summary.pool_wait_seconds += result.pool_wait_seconds
        summary.gpu_forward_seconds += result.gpu_forward_seconds
        summary.gpu_between_seconds += result.gpu_between_seconds
        summary.units_run_eager_while_compiling += not result.compiled and summary.compiled
        summary.compiled_graphs = max(summary.compiled_graphs, result.compiled_graphs)
        summary.compile_seconds = max(summary.compile_seconds, result.compile_seconds)
        self.marks.add(result)


@dataclass
class TimelineMarks:
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

    def fill(
        self, summary: ExtractionSummary, started_at: float, ended_at: float, job_started_at: float
    ) -> None:
        if not self.last_forward:  # no unit ran
            return
        first_forward = self.gpu_first_forward if self.gpu_last_forward else self.first_forward
        summary.first_forward_seconds = max(0.0, first_forward - job_started_at)
        summary.head_seconds = max(0.0, self.first_forward - started_at)
        summary.tail_seconds = max(0.0, ended_at - self.last_forward)
        if self.last_landed:
            summary.tail_after_landed_seconds = max(0.0, ended_at - self.last_landed)
        if self.gpu_last_forward:
            summary.gpu_head_seconds = max(0.0, self.gpu_first_forward - started_at)
            summary.gpu_tail_seconds = max(0.0, ended_at - self.gpu_last_forward)
