"""The end-of-run summary of an extraction: what went in, what was kept, what it cost."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.extract.units import WorkerStartup


@dataclass
class ExtractionSummary:
    """Returned by ``run_extraction`` and printed by ``hsstore extract``.

    Counts of samples and tokens cover the whole store (this run plus what earlier runs had
    committed); ``*_written`` and the rates cover this run only. ``rejected`` counts by reason,
    planning's and the worker's (``worker_error``: records the target raised on) alike, so a
    resume reports the same counts as the run it finishes.
    """

    store: str
    rejects_path: str
    dry_run: bool = False  # planned only: nothing was extracted or written
    executor: str = ""  # what ran the workers: "local" or "ray" (``executor: auto`` resolved)
    num_records: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    num_samples_written: int = 0
    num_tokens_written: int = 0
    num_units: int = 0
    num_units_skipped: int = 0
    num_units_elsewhere: int = 0  # other partition ranks' units not committed when this run ended
    rejected: dict[str, int] = field(default_factory=dict)
    num_truncated: int = 0
    num_padded_tokens: int = 0
    store_bytes: int = 0
    feature_bytes_per_token: int = 0
    wall_seconds: float = 0.0
    extract_seconds: float = 0.0
    num_workers: int = 0
    # Units this run extracted, by the Ray node (node id) whose actor ran them; empty in process.
    units_by_node: dict[str, int] = field(default_factory=dict)
    # Summed over units: the shard writer threads' busy time (encode on CPU, checks, appends) and
    # their time waiting for device-to-host copies.
    writer_busy_seconds: float = 0.0
    copy_wait_seconds: float = 0.0
    # Where a worker's model was not running forwards (on one host: wall clocks compared):
    # compute_seconds sums the units' forward spans; head = start to the first unit's forwards
    # (planning, tokenizing and handing out the first unit); tail = the last unit's forwards to
    # the end (draining its writer, finishing and committing the last shard).
    compute_seconds: float = 0.0
    pool_wait_seconds: float = 0.0  # of compute_seconds: waiting for free host buffers (writer back-pressure)
    head_seconds: float = 0.0
    tail_seconds: float = 0.0
    # Of the tail: from the last batch's features on the host (the GPU's work done) to the end:
    # the host's part (the last writes, the shard's finish and commit); the rest of the tail is
    # the GPU still running the forwards the host had queued ahead.
    tail_after_landed_seconds: float = 0.0
    # On GPUs (one per worker), from CUDA events, summed over units: the devices' time in the
    # forwards and between consecutive forwards (idle, or the fp8 encode). Host timers cannot tell
    # these apart: the host queues work ~0.5 s ahead of the GPU.
    gpu_forward_seconds: float = 0.0
    gpu_between_seconds: float = 0.0
    # The same events against the wall clock: the start to the first forward running on a GPU, and
    # the last forward's end on a GPU to the end (what a bare forward of these batches never pays).
    gpu_head_seconds: float = 0.0
    gpu_tail_seconds: float = 0.0
    # The start (docs/extraction.md, "Compiled forwards and a fast start"), from the job's start:
    # every worker ready (model loaded, warmed up) and the first unit's first forward
    # (on the GPU where known). The slowest worker's model load and (eager) warm-up; whether the
    # layers were compiled (in the background), and into how many graphs. The target's weights
    # and the data hashed for the lineage on a daemon thread meanwhile, and what the first commit
    # (a resume: the planning) waited for them.
    workers_ready_seconds: float = 0.0
    first_forward_seconds: float = 0.0
    model_load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    # The rest of the start, in order: the driver's tokenizer and target config (``prepare``,
    # from the job's start); starting the executor (``ray.init()`` and the actors asked for; in
    # process: the worker's thread); the first worker's constructor entered (from the job's start:
    # a Ray actor's process up, its modules imported); the slowest worker pinning its host
    # buffers; the first unit to run planned (from the job's start).
    prepare_seconds: float = 0.0
    executor_start_seconds: float = 0.0
    worker_start_seconds: float = 0.0
    host_buffers_seconds: float = 0.0
    first_unit_planned_seconds: float = 0.0
    compiled: bool = False
    compiled_graphs: int = 0  # the most any worker compiled (1: one graph serves every batch)
    # Units run eager while the layers compiled in the background (compiled_layers.py).
    units_run_eager_while_compiling: int = 0
    compile_seconds: float = 0.0  # the slowest worker's background compile (0.0: none finished)
    fingerprint_seconds: float = 0.0
    lineage_wait_seconds: float = 0.0

    def record_startup(self, startups: Sequence[WorkerStartup], job_started_at: float) -> None:
        """The workers' start-up reports (executor.wait_ready)."""
        if not startups:
            return
        self.workers_ready_seconds = max(0.0, max(s.ready_at for s in startups) - job_started_at)
        if all(s.entered_at for s in startups):
            self.worker_start_seconds = max(0.0, min(s.entered_at for s in startups) - job_started_at)
        self.host_buffers_seconds = max(s.buffers_seconds for s in startups)
        self.model_load_seconds = max(s.load_seconds for s in startups)
        self.warmup_seconds = max(s.warmup_seconds for s in startups)
        self.compiled = all(s.compiled for s in startups)

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    @property
    def padding_waste(self) -> float:
        """Fraction of the computed tokens (this run) that were padding."""
        if not self.num_padded_tokens:
            return 0.0
        return 1.0 - self.num_tokens_written / self.num_padded_tokens

    @property
    def bytes_per_token(self) -> float:
        """Store bytes (features, sample table, metadata) per stored token."""
        return self.store_bytes / self.num_tokens if self.num_tokens else 0.0

    @property
    def writer_busy_fraction(self) -> float:
        """How busy the writer threads were over the run, per worker (1.0: the writing was the limit)."""
        span = self.extract_seconds * max(1, self.num_workers)
        return self.writer_busy_seconds / span if span else 0.0

    @property
    def compute_busy_fraction(self) -> float:
        """How much of the run the workers' models spent in units' forwards (1.0: never idle)."""
        span = self.extract_seconds * max(1, self.num_workers)
        return self.compute_seconds / span if span else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens_written / self.extract_seconds if self.extract_seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            num_rejected=self.num_rejected,
            padding_waste=self.padding_waste,
            bytes_per_token=self.bytes_per_token,
            tokens_per_second=self.tokens_per_second,
            writer_busy_fraction=self.writer_busy_fraction,
            compute_busy_fraction=self.compute_busy_fraction,
        )
        return data

    def format(self) -> str:
        """The human summary, one fact a line."""
        rejected = (
            ", ".join(f"{reason} {count}" for reason, count in self.rejected.items()) or "none"
        )
        if self.dry_run:
            return "\n".join([
                f"dry run          planned only; nothing extracted, nothing written to {self.store}",
                f"records read     {self.num_records}",
                f"samples          {self.num_samples}",
                f"tokens           {self.num_tokens} ({self.num_loss_tokens} with loss)",
                f"rejected         {self.num_rejected}: {rejected}",
                f"truncated        {self.num_truncated}",
                f"units            {self.num_units}",
                f"padding (plan)   {100 * self.padding_waste:.2f}% of computed tokens",
                f"features         {self.feature_bytes_per_token:,} bytes/token raw, "
                f"{self.feature_bytes_per_token * self.num_tokens / 1e9:,.1f} GB for these tokens",
                f"wall time        {self.wall_seconds:.1f} s",
            ])
        lines = [
            f"store            {self.store}",
            f"records read     {self.num_records}",
            f"samples          {self.num_samples} ({self.num_samples_written} written now, "
            f"{self.num_samples - self.num_samples_written} already committed)",
            f"tokens           {self.num_tokens} ({self.num_loss_tokens} with loss)",
            f"units            {self.num_units} ({self.num_units_skipped} skipped: already committed"
            + (f"; {self.num_units_elsewhere} of other ranks pending" if self.num_units_elsewhere else "")
            + ")",
            f"rejected         {self.num_rejected}: {rejected}",
            f"rejects file     {self.rejects_path}",
            f"truncated        {self.num_truncated}",
            f"padding waste    {100 * self.padding_waste:.1f}% of computed tokens",
            f"bytes per token  {self.bytes_per_token:,.0f} in the store "
            f"({self.feature_bytes_per_token:,} of raw features)",
            f"wall time        {self.wall_seconds:.1f} s ({self.tokens_per_second:,.0f} tokens/s extracting)",
            f"writer busy      {100 * self.writer_busy_fraction:.0f}% of the run per worker "
            f"({self.num_workers} worker(s))",
            f"forwards         {100 * self.compute_busy_fraction:.0f}% of the run per worker "
            f"(first unit after {self.head_seconds:.1f} s, last shard done {self.tail_seconds:.1f} s "
            "after its forwards)",
        ]
        if self.workers_ready_seconds:
            compiled = (
                f"; compiled in the background in {self.compile_seconds:.1f} s into {self.compiled_graphs} graph(s), "
                f"{self.units_run_eager_while_compiling} unit(s) eager meanwhile"
                if self.compiled else ", eager"
            )
            lines += [
                f"start            prepared after {self.prepare_seconds:.1f} s, executor ({self.executor}) started in "
                f"{self.executor_start_seconds:.1f} s, first worker up after {self.worker_start_seconds:.1f} s, "
                f"first unit planned after {self.first_unit_planned_seconds:.1f} s",
                f"                 workers ready after {self.workers_ready_seconds:.1f} s (model loaded in "
                f"{self.model_load_seconds:.1f} s, host buffers {self.host_buffers_seconds:.1f} s, warm-up "
                f"{self.warmup_seconds:.1f} s{compiled}); first forward after {self.first_forward_seconds:.1f} s; "
                f"lineage hashed in {self.fingerprint_seconds:.1f} s beside it (waited {self.lineage_wait_seconds:.1f} s)",
            ]
        if len(self.units_by_node) > 1:
            counts = ", ".join(f"{node[:8]} {n}" for node, n in sorted(self.units_by_node.items()))
            lines.append(f"ray nodes        {len(self.units_by_node)} ran units (units per node id: {counts})")
        if self.gpu_forward_seconds:
            lines.append(
                f"GPU              {self.gpu_forward_seconds:.1f} s in forwards, "
                f"{self.gpu_between_seconds:.2f} s between them (summed over workers); first "
                f"forward on a GPU after {self.gpu_head_seconds:.2f} s, last one done "
                f"{self.gpu_tail_seconds:.2f} s before the end"
            )
        return "\n".join(lines)
