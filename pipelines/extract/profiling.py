"""A torch.profiler trace of a worker's first batches (``profiler.dir`` in the extraction recipe).

What happens between a unit's start and the GPU's first forward, or between two forwards, is
invisible in the summary's totals; a trace shows it: host ranges (the unit's set-up, each batch's
collate, forward and hand-off to the sink) and, on a GPU, every kernel and copy on the device
timeline. Like ``VLLM_TORCH_PROFILER_DIR`` in vLLM, it is a diagnostic: tracing slows the traced
forwards, so a traced run's tokens/s are not a measurement.

Only the first ``profiler.batches`` forwards of each worker's first unit are traced (the start is
where one-off costs hide, and a trace of an 8B model's forward is ~1 MB per batch). The trace is
written as ``extract-<host>-<pid>-u<unit>.pt.trace.json.gz`` in ``profiler.dir`` on the worker's
machine: Chrome's about:tracing, Perfetto (ui.perfetto.dev) and TensorBoard open it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch

from pipelines.extract.units import unit_shard_id

logger = logging.getLogger(__name__)

# Host ranges the worker marks (torch.profiler.record_function), so a trace reads as the worker's
# own steps, not only as aten ops.
UNIT_SETUP = "hsstore.unit_setup"  # planning the unit's batches, its ShardWriter and sink
BATCH = "hsstore.batch"  # one batch: collate, forward, hand-off to the sink
SUBMIT = "hsstore.sink_submit"  # the batch's features handed to the sink (copies start)
UNIT_FLUSH = "hsstore.unit_flush"  # the unit's last copies issued


class FirstBatchesProfiler:
    """Traces one worker's first unit from its start to its ``batches``-th forward (or its end).

    ``with profiler.unit(unit_index):`` around each unit's forwards (``start`` and ``stop``);
    ``batch_done()`` after each batch. Only the first unit started is traced; with ``directory``
    None every call does nothing."""

    def __init__(self, directory: str | None, batches: int, device: torch.device):
        self.directory = directory
        self.batches = batches
        self.device = device
        self._profile: torch.profiler.profile | None = None
        self._unit_index = -1
        self._seen = 0
        self._done = directory is None
        self.written: Path | None = None  # the trace, once written

    @contextlib.contextmanager
    def unit(self, unit_index: int) -> Iterator[None]:
        """Trace this unit if it is the first; the trace ends with it at the latest, also when it
        fails (a unit of fewer batches than ``batches``, or one that could not start)."""
        self.start(unit_index)
        try:
            yield
        finally:
            self.stop()

    def start(self, unit_index: int) -> None:
        if self._done or self._profile is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()
        self._unit_index = unit_index
        self._seen = 0

    def batch_done(self) -> None:
        if self._profile is None:
            return
        self._seen += 1
        if self._seen >= self.batches:
            self.stop()

    def stop(self) -> None:
        """End the trace and write it (the unit's forwards ended, or enough batches seen)."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        self._done = True
        profile.stop()
        assert self.directory is not None
        folder = Path(self.directory)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            shard_id = unit_shard_id(self._unit_index)
            path = folder / f"extract-{socket.gethostname()}-{os.getpid()}-{shard_id}.pt.trace.json.gz"
            profile.export_chrome_trace(str(path))  # gzipped: the name ends in .gz
        except OSError as err:
            # A diagnostic must not fail the extraction it looks at.
            logger.warning("profiler.dir %s: the trace could not be written (%s)", folder, err)
            return
        self.written = path
        logger.info("wrote a trace of unit %d's first %d batch(es) to %s", self._unit_index, self._seen, path)
