"""The end-of-run summary of a generation, printed by ``hsstore generate``."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pipelines.generate.manifest import GenerationManifest


@dataclass
class GenerationSummary:
    """Counts cover the whole dataset (this run plus earlier runs' committed units); the rate
    covers this run's new tokens only."""

    output: str
    num_records: int = 0
    num_written: int = 0
    num_answers: int = 0
    num_new_tokens: int = 0
    num_truncated: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    num_units: int = 0
    num_units_skipped: int = 0
    num_units_written: int = 0
    num_workers: int = 0
    new_tokens_this_run: int = 0
    generate_seconds: float = 0.0
    wall_seconds: float = 0.0
    stopped_by_signal: int | None = None  # SIGTERM/SIGINT: the units in flight committed, no others

    def fill(self, manifest: GenerationManifest) -> None:
        shards = manifest.shards
        self.num_units = len(shards)
        self.num_records = sum(s.num_records for s in shards)
        self.num_written = sum(s.num_written for s in shards)
        self.num_answers = sum(s.num_answers for s in shards)
        self.num_new_tokens = sum(s.num_new_tokens for s in shards)
        self.num_truncated = sum(s.num_truncated for s in shards)
        reasons: Counter[str] = Counter()
        for shard in shards:
            reasons.update(shard.rejected)
        self.rejected = dict(sorted(reasons.items()))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens_this_run / self.generate_seconds if self.generate_seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}

    def format(self) -> str:
        rejected = ", ".join(f"{k} {v}" for k, v in self.rejected.items()) or "none"
        lines = [
            f"generated dataset {self.output}",
            f"  records    {self.num_records} read, {self.num_written} written, "
            f"{self.num_truncated} with an answer cut short",
            f"  rejected   {rejected}",
            f"  answers    {self.num_answers} ({self.num_new_tokens} new tokens)",
            f"  units      {self.num_units} ({self.num_units_skipped} already committed, "
            f"{self.num_units_written} written now by {self.num_workers} worker(s))",
            f"  this run   {self.new_tokens_this_run} tokens in {self.generate_seconds:.1f} s "
            f"({self.tokens_per_second:.1f} tokens/s); wall {self.wall_seconds:.1f} s",
        ]
        if self.stopped_by_signal is not None:
            lines.append(
                f"  stopped    by signal {self.stopped_by_signal} after committing the units in "
                "flight; not complete: rerun the same command to resume"
            )
        return "\n".join(lines)
