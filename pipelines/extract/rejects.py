"""Rejected records: the rejects file, and the worker's rejections kept per unit.

Every rejected record, whatever rejected it, is one JSON line of ``<store>/rejects/extract.jsonl``
(rewritten on each run, which re-derives them all). Planning rejects records as it reads them; the
worker rejects the records the target raised on (``worker_error``), and those are saved per unit
under ``rejects/units/`` before the unit's commit, so a resume that skips a committed unit still
reports them: a rerun gives the same rejects.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable

from hsstore.storage import StoreLocation
from pipelines.extract.errors import ExtractionError
from pipelines.extract.records import Rejection, RejectReason
from pipelines.extract.summary import ExtractionSummary
from pipelines.extract.units import RejectedSample, UnitResult, WorkUnit, unit_shard_id

logger = logging.getLogger(__name__)

REJECTS_PATH = "rejects/extract.jsonl"
# Per-unit worker rejections, one JSON-lines file per unit that has any (``u000042.jsonl``).
UNIT_REJECTS_DIR = "rejects/units"


def write_rejects(location: StoreLocation, rejections: list[Rejection]) -> str:
    """Write every rejection as a JSON line to ``<store>/rejects/extract.jsonl`` (atomic; rewritten
    on each run, since a run re-derives them all). Returns the file's path."""
    lines = [json.dumps(r.to_json(), ensure_ascii=False) for r in rejections]
    data = ("\n".join(lines) + "\n" if lines else "").encode("utf-8")
    location.makedirs("rejects")
    location.write_bytes_atomic(REJECTS_PATH, data)
    return location.path(REJECTS_PATH)


class UnitRejects:
    """The worker's rejections per unit, kept in ``rejects/units/<shard id>.jsonl``.

    A unit's file is written before its commit, and removed when a rerun of an uncommitted unit
    rejects nothing, so for every committed unit the file (or its absence) is that unit's truth.
    One listing at start; no per-unit I/O for units without rejections.
    """

    def __init__(self, location: StoreLocation):
        self.location = location
        self.by_unit: dict[int, tuple[RejectedSample, ...]] = {}
        names = (path.rsplit("/", 1)[-1] for path in location.list_files(UNIT_REJECTS_DIR))
        self._on_disk = {
            n.removesuffix(".jsonl")
            for n in names
            if n.endswith(".jsonl") and not n.startswith(".")
        }

    @staticmethod
    def path(shard_id: str) -> str:
        return f"{UNIT_REJECTS_DIR}/{shard_id}.jsonl"

    def load(self, unit_indices: Iterable[int]) -> None:
        """Read the rejections of committed units (earlier runs', other ranks')."""
        for index in unit_indices:
            if unit_shard_id(index) in self._on_disk:
                self.by_unit[index] = self._read(index)

    def _read(self, index: int) -> tuple[RejectedSample, ...]:
        shard_id = unit_shard_id(index)
        path = self.path(shard_id)
        rejected = []
        for line_no, line in enumerate(
            self.location.read_bytes(path).decode("utf-8").splitlines(), 1
        ):
            try:
                entry = json.loads(line)
                r = entry["rejection"]
                rejection = Rejection(
                    RejectReason(r["reason"]),
                    r["message"],
                    r["origin"],
                    r["source_id"],
                    r["excerpt"],
                )
                sample = RejectedSample(
                    int(entry["position"]),
                    str(entry["sample_id"]),
                    rejection,
                    int(entry["num_tokens"]),
                    int(entry["num_loss_tokens"]),
                )
            except (ValueError, KeyError, TypeError) as err:
                raise ExtractionError(
                    f"{self.location.path(path)}:{line_no}: not a rejection this extraction wrote "
                    f"({type(err).__name__}: {err}); remove the file and the shard {shard_id} "
                    "from the store to redo the unit"
                ) from err
            rejected.append(sample)
        return tuple(rejected)

    def save(self, result: UnitResult, unit: WorkUnit) -> None:
        """Keep a finished unit's rejections (called before its commit)."""
        path = self.path(unit.shard_id)
        if result.rejected:
            lines = [
                json.dumps(
                    {
                        "position": r.position,
                        "sample_id": r.sample_id,
                        "num_tokens": r.num_tokens,
                        "num_loss_tokens": r.num_loss_tokens,
                        "rejection": r.rejection.to_json(),
                    },
                    ensure_ascii=False,
                )
                for r in result.rejected
            ]
            self.location.write_bytes_atomic(path, ("\n".join(lines) + "\n").encode("utf-8"))
            self._on_disk.add(unit.shard_id)
            for r in result.rejected:
                logger.warning("rejected (%s) %s", r.rejection.reason, r.rejection.message)
        elif unit.shard_id in self._on_disk:
            # Left by an attempt that crashed before its commit and rejected something this one
            # did not: it must not speak for the committed unit on a later resume.
            self.location.delete(path)
            self._on_disk.discard(unit.shard_id)
        if result.rejected:
            self.by_unit[unit.index] = result.rejected
        else:
            self.by_unit.pop(unit.index, None)

    def rejections(self) -> list[Rejection]:
        """Every unit's rejections, by unit then input order (the same whatever finished first)."""
        return [r.rejection for index in sorted(self.by_unit) for r in self.by_unit[index]]


def count_worker_rejections(summary: ExtractionSummary, unit_rejects: UnitRejects) -> None:
    """Move the samples the worker rejected from the accepted counts to the rejected ones."""
    if not unit_rejects.by_unit:
        return
    reasons: Counter[str] = Counter(summary.rejected)
    for rejected in unit_rejects.by_unit.values():
        for r in rejected:
            summary.num_samples -= 1
            summary.num_tokens -= r.num_tokens
            summary.num_loss_tokens -= r.num_loss_tokens
            reasons[str(r.rejection.reason)] += 1
    summary.rejected = dict(sorted(reasons.items()))
