"""Executors: who runs the workers. In process (debugging, profiling, the GPU benchmark) or Ray actors.

Both take the same :class:`WorkerSpec` and units and call ``on_result`` in the driver as each unit
finishes, which is where the driver commits that unit's shard. So a crash of the driver loses at
most the units in flight, and the in-process executor runs exactly the worker code the actors run.

Ray design (docs/extraction.md has the long form): Ray *core actors*, not Ray Data. A unit is a
whole shard, written by the actor straight to the store; only the small ShardRecord comes back
through the object store. Ray Data's ``map_batches`` would move features through the object store
(a copy of ~24 KiB/token for an 8B target, and no bf16 dtype) and offers no per-unit commit point.
Actors are created with ``max_restarts``/``max_task_retries``: a unit whose actor died is rerun on
the restarted actor, and since a unit always writes the same shard id into a fresh attempt folder
and the committer keeps the first record per id, a unit run twice is committed once.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

from hsstore.errors import HsstoreError
from pipelines.extract.errors import ExtractionError
from pipelines.extract.recipe import RaySection
from pipelines.extract.units import WorkUnit

logger = logging.getLogger(__name__)

ResultCallback = Callable[[Any], None]  # UnitResult for extraction
# Units a worker holds at once: one running forwards, one finishing its shard (worker.run_unit).
UNITS_IN_FLIGHT = 2


def extraction_worker(spec: Any) -> Any:
    """The default worker, imported where it is built: the worker module imports torch, which the
    driver of a Ray run never needs (seconds on its start's critical path; the actors import it
    while the driver plans)."""
    from pipelines.extract.worker import ExtractionWorker

    return ExtractionWorker(spec)


class LocalExecutor:
    """Runs the worker in this process, one unit after another.

    ``worker_class`` builds the worker from ``spec`` (default: extraction's); any class with
    ``run_unit(unit, on_batch)`` and ``close()`` fits (``hsstore generate`` passes its own). The
    worker is built on a thread of its own, so that the driver plans while the model loads (the
    fast start); :meth:`wait_ready` (and :meth:`run`) wait for it and raise what building it
    raised.
    """

    def __init__(
        self, spec: Any, worker: Any | None = None, worker_class: Callable[[Any], Any] = extraction_worker
    ):
        from concurrent.futures import Future, ThreadPoolExecutor

        if worker is not None:
            self._worker: Future[Any] = Future()
            self._worker.set_result(worker)
        else:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-worker")
            self._worker = pool.submit(worker_class, spec)
            pool.shutdown(wait=False)  # returns now; the pool's thread ends once the worker is built

    @property
    def worker(self) -> Any:
        return self._worker.result()

    def wait_ready(self) -> list[Any]:
        """The worker's start-up report (``[None]`` for workers that keep none), once it is built."""
        return [getattr(self.worker, "startup", None)]

    def run(
        self,
        units: Iterable[WorkUnit],
        on_result: ResultCallback,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        """Two units in flight: one computing, the previous one finishing its shard.

        ``on_batch(num_samples, num_tokens)`` reports each batch (from a worker thread). A failed
        unit raises what ``run_unit`` raised: an :class:`ExtractionError` naming the unit (or an
        hsstore error naming its shard)."""
        from concurrent.futures import ThreadPoolExecutor

        self.wait_ready()
        in_flight: deque[Any] = deque()
        with ThreadPoolExecutor(max_workers=UNITS_IN_FLIGHT, thread_name_prefix="unit") as pool:
            try:
                for unit in units:
                    in_flight.append(pool.submit(self.worker.run_unit, unit, on_batch))
                    if len(in_flight) >= UNITS_IN_FLIGHT:
                        on_result(in_flight.popleft().result())
                while in_flight:
                    on_result(in_flight.popleft().result())
            finally:
                for future in in_flight:
                    future.cancel()

    def close(self) -> None:
        if self._worker.exception() is None:  # waits for a worker still being built
            self.worker.close()


class _WorkerActor:
    """The Ray actor: a worker that lives as long as the actor (the model stays loaded)."""

    def __init__(self, spec: Any, worker_class: Callable[[Any], Any] = extraction_worker):
        self.worker = worker_class(spec)

    def run_unit(self, unit: Any) -> tuple[str, Any]:
        """The unit's result and the Ray node that ran it (a restarted actor may run elsewhere)."""
        import ray

        return ray.get_runtime_context().get_node_id(), self.worker.run_unit(unit)

    def pid(self) -> int:
        import os

        return os.getpid()

    def startup(self) -> Any:
        """The worker's start-up report (``WorkerStartup``), None for workers that keep none."""
        return getattr(self.worker, "startup", None)


def start_ray(settings: RaySection) -> bool:
    """``ray.init`` as a :class:`RayExecutor` would (joining ``settings.address``, or a local Ray);
    True when this call started it, so that its caller shuts it down. The driver calls it while
    it prepares the job on another thread (``driver.prepare_beside_ray``); the executor then finds
    Ray initialised and leaves its shutdown to the driver."""
    try:
        import ray
    except ImportError as err:
        raise ExtractionError(
            "executor: ray, but Ray is not installed here; install it (pip install 'hsstore[extract]') "
            "or run in process with --set executor=local"
        ) from err
    if ray.is_initialized():
        return False
    ray.init(address=settings.address, include_dashboard=False, log_to_driver=True)
    return True


class RayExecutor:
    """Ray core actors: one per GPU (or ``num_workers`` CPU actors); the driver hands out units.

    Joins the cluster at ``settings.address`` or starts Ray locally when Ray is not initialised yet
    (and shuts it down on :meth:`close` only then). ``worker_class`` as for :class:`LocalExecutor`;
    ``spec`` must be a dataclass with ``device`` and ``num_gpus`` fields (they are set per actor).
    """

    def __init__(
        self,
        spec: Any,
        settings: RaySection,
        worker_class: Callable[[Any], Any] = extraction_worker,
        job: str = "extraction",
    ):
        self._started_ray = start_ray(settings)
        import ray

        self.settings = settings
        # Units whose result came back, by the Ray node id that ran them (the run summary's).
        self.units_by_node: Counter[str] = Counter()
        cluster_gpus = float(ray.cluster_resources().get("GPU", 0.0))
        num_gpus = settings.num_gpus_per_worker
        if num_gpus is None:
            num_gpus = 1.0 if cluster_gpus >= 1 else 0.0
        num_workers = settings.num_workers
        if num_workers is None:
            num_workers = max(1, int(cluster_gpus // num_gpus)) if num_gpus else 1
        if num_gpus > 1:
            if num_gpus != int(num_gpus):
                raise ExtractionError(
                    f"ray.num_gpus_per_worker={num_gpus}: more than one GPU per actor must be a "
                    "whole number (the target is split over them)"
                )
            spec = _replace(spec, num_gpus=int(num_gpus))
        if num_gpus == 0 and spec.device == "auto":
            # An actor given no GPU must not grab one the scheduler gave to another actor.
            spec = _replace(spec, device="cpu")
        actor_class = ray.remote(_WorkerActor).options(
            num_cpus=settings.num_cpus_per_worker,
            num_gpus=num_gpus,
            resources=dict(settings.resources_per_worker) or None,
            max_restarts=settings.max_restarts,
            max_task_retries=settings.max_task_retries,
            # Over the nodes, not packed onto the first one with room: a multi-node cluster's
            # CPU actors use every node, and a node lost takes as few actors as it can.
            scheduling_strategy="SPREAD",
            # Two threads: a unit finishing its shard overlaps the next unit's forwards.
            max_concurrency=UNITS_IN_FLIGHT,
        )
        # Created without waiting: each actor loads the model in its own process while the driver
        # plans (the fast start); wait_ready() waits for them.
        self.actors = [actor_class.remote(spec, worker_class) for _ in range(num_workers)]
        self.pids: list[int] = []  # set by wait_ready
        self._startups: list[Any] | None = None
        self._description = f"{num_workers} {job} actors ({num_gpus} GPU each)"

    def wait_ready(self) -> list[Any]:
        """Wait for every actor to be built (model loaded, warmed up); their start-up reports.

        The pids name the processes in logs (and the tests SIGKILL one to check that its units
        are retried). An actor whose constructor raised raises here, as the constructor's error."""
        import ray
        from ray.exceptions import RayActorError

        if self._startups is None:
            try:
                self.pids = ray.get([actor.pid.remote() for actor in self.actors])
            except RayActorError as err:  # its constructor raised: the message carries the error
                raise ExtractionError(f"a worker actor failed to start: {err}") from err
            self._startups = ray.get([actor.startup.remote() for actor in self.actors])
            logger.info("started %s", self._description)
        return self._startups

    def run(
        self,
        units: Iterable[Any],
        on_result: ResultCallback,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        """Hand out units, ``on_result`` as each comes back. Progress is per unit: ``on_batch``
        is accepted for symmetry with LocalExecutor and not called (actors report per unit)."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        self.wait_ready()
        pending = iter(units)  # pulled as actors free up: the driver plans in a stream
        in_flight: dict[Any, tuple[Any, Any]] = {}
        resent: Counter[int] = Counter()  # units sent again after ActorUnavailableError

        def submit(actor: Any) -> None:
            unit = next(pending, None)
            if unit is not None:
                in_flight[actor.run_unit.remote(unit)] = (actor, unit)

        for _ in range(self.settings.units_in_flight_per_worker):
            for actor in self.actors:
                submit(actor)
        while in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            ref = ready[0]
            actor, unit = in_flight.pop(ref)
            try:
                node_id, result = ray.get(ref)
            except RayTaskError as err:
                if isinstance(err.cause, HsstoreError):
                    # The worker's own error already names the unit (or the shard), and keeps
                    # its type (a StoreWriteError is still an OSError to the caller).
                    raise err.cause from err
                raise ExtractionError(
                    f"unit {unit.index} (shard {unit.shard_id}) failed: {err.cause or err}"
                ) from err
            except ActorUnavailableError as err:
                # The actor's process or node went away with the unit in flight (a node lost):
                # Ray does not retry a call that may have run, but a unit may run twice (the same
                # shard id into a fresh attempt folder; the committer keeps the first record), so
                # it is sent again. The handle reaches the actor once Ray has restarted it.
                resent[unit.index] += 1
                if resent[unit.index] > self.settings.max_task_retries:
                    raise ExtractionError(
                        f"unit {unit.index} (shard {unit.shard_id}): its actor was unavailable "
                        f"{resent[unit.index]} times (max_task_retries="
                        f"{self.settings.max_task_retries}; {err}); rerun the same recipe to resume"
                    ) from err
                logger.warning(
                    "unit %d: its actor is unavailable (a node lost?); sending it again (%d of %d)",
                    unit.index,
                    resent[unit.index],
                    self.settings.max_task_retries,
                )
                in_flight[actor.run_unit.remote(unit)] = (actor, unit)
                continue
            except RayActorError as err:
                raise ExtractionError(
                    f"unit {unit.index} (shard {unit.shard_id}): its actor died more than "
                    f"max_restarts={self.settings.max_restarts} times ({err}); rerun the same "
                    "recipe to resume"
                ) from err
            self.units_by_node[node_id] += 1
            on_result(result)
            submit(actor)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._started_ray:
            ray.shutdown()


def _replace(spec: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(spec, **changes)
