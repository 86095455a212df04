"""Planning in a stream: records -> tokenized samples -> length-sorted windows -> work units.

Nothing here holds the dataset. Records are read one at a time, tokenized in blocks by a pool of
processes (``planning.num_workers``, default every core this process may use) in input order, and
gathered into windows of about ``units.sort_window_tokens`` accepted tokens; each window is sorted
by length and cut into units, which the driver hands to the executor as soon as the window closes.
Memory is one window of samples plus the blocks in flight, plus one sample id and origin per
accepted sample (to reject duplicates).

Each planned window is written to the store's plan journal (``plan/windows/w000003.json``: the
records it consumed, its units, counts, rejections, sample ids) before its units run. A resume
reads the journal and, for every window whose units are all committed, skips its records without
tokenizing them (they are read, and parsed, only to be counted past). Planning is deterministic,
so the windows a resume plans afresh are the ones the journal describes.

The data fingerprint of the lineage is the sha256 of the input files' bytes (and the record
limit): known before any record is tokenized, so the store can be created and checked first.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import posixpath
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec

from hsstore.storage import StoreLocation
from pipelines.extract.errors import ExtractionError, RecordSourceError
from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.records import Rejection, RejectReason, iter_records
from pipelines.extract.tokenize import SampleTokenizer, TokenizedSample
from pipelines.extract.tokenizer_pool import BlockTokenizer
from pipelines.extract.units import WorkUnit, cut_window, unit_shard_id, window_is_full

logger = logging.getLogger(__name__)

JOURNAL_DIR = "plan/windows"


def data_fingerprint(recipe: ExtractRecipe) -> str:
    """sha256 over each input file's name and bytes, in order, and the record limit."""
    digest = hashlib.sha256()
    for url in recipe.data:
        digest.update(posixpath.basename(url.rstrip("/")).encode() + b"\0")
        try:
            with fsspec.open(url, "rb") as handle:
                while block := handle.read(8 << 20):
                    digest.update(block)
        except FileNotFoundError as err:
            raise RecordSourceError(f"data file {url} does not exist") from err
        except IsADirectoryError as err:
            raise RecordSourceError(
                f"data {url} is a folder: give its JSONL or Parquet files (only a folder that hsstore "
                "generate wrote reads as its shards)"
            ) from err
        digest.update(b"\0")
    digest.update(f"limit={recipe.limit}".encode())
    return digest.hexdigest()


@dataclass
class WindowPlan:
    """One window: the records it consumed, its units, and what planning counted in it."""

    index: int
    first_record: int
    num_records: int = 0
    first_unit: int = 0
    num_units: int = 0
    units: list[WorkUnit] = field(default_factory=list)  # empty when replayed from the journal
    rejections: list[Rejection] = field(default_factory=list)
    num_samples: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    num_truncated: int = 0
    samples: list[tuple[str, str]] = field(default_factory=list)  # (sample_id, origin), input order
    from_journal: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "first_record": self.first_record,
            "num_records": self.num_records,
            "first_unit": self.first_unit,
            "num_units": self.num_units,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "num_truncated": self.num_truncated,
            "rejections": [r.to_json() for r in self.rejections],
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WindowPlan:
        rejections = [
            Rejection(RejectReason(r["reason"]), r["message"], r["origin"], r["source_id"], r["excerpt"])
            for r in data["rejections"]
        ]
        plain = {k: data[k] for k in ("index", "first_record", "num_records", "first_unit", "num_units",
                                      "num_samples", "num_tokens", "num_loss_tokens", "num_truncated")}
        return cls(**plain, rejections=rejections, samples=[tuple(s) for s in data["samples"]], from_journal=True)


class PlanJournal:
    """The store's record of planned windows (``plan/windows/``); never read by store readers."""

    def __init__(self, location: StoreLocation):
        self.location = location

    @staticmethod
    def path(index: int) -> str:
        return f"{JOURNAL_DIR}/w{index:06d}.json"

    def read(self) -> dict[int, WindowPlan]:
        windows: dict[int, WindowPlan] = {}
        for path in self.location.list_files(JOURNAL_DIR):
            name = path.rsplit("/", 1)[-1]
            if not (name.startswith("w") and name.endswith(".json")):
                continue  # temp files of an interrupted write
            try:
                window = WindowPlan.from_json(json.loads(self.location.read_bytes(path)))
            except (ValueError, KeyError, TypeError) as err:
                raise ExtractionError(
                    f"{self.location.path(path)}: not a plan journal entry this extraction wrote "
                    f"({type(err).__name__}: {err}); remove the folder {JOURNAL_DIR} to plan afresh"
                ) from err
            windows[window.index] = window
        return windows

    def write(self, window: WindowPlan) -> None:
        self.location.makedirs(JOURNAL_DIR)
        data = json.dumps(window.to_json(), ensure_ascii=False).encode("utf-8")
        self.location.write_bytes_atomic(self.path(window.index), data)


def default_num_workers() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# -- the planner -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Skip:
    """A journal window whose units are all committed: its records are counted past, untokenized."""

    window: WindowPlan


class StreamPlanner:
    """Yields the recipe's windows in order (:meth:`windows`), journal-replayed or freshly planned."""

    def __init__(
        self,
        recipe: ExtractRecipe,
        tokenizer: SampleTokenizer,
        tokenizer_dir: str,
        *,
        journal: PlanJournal | None = None,
        committed: set[str] | None = None,
    ):
        self.recipe = recipe
        self.tokenizer = tokenizer
        self.journal = journal
        self.committed = committed or set()
        num_workers = recipe.planning.num_workers or default_num_workers()
        self.block_tokenizer = BlockTokenizer(tokenizer, recipe, tokenizer_dir, num_workers)
        self.rejected: Counter[str] = Counter()
        self._seen: dict[str, str] = {}  # sample id -> origin of its first record
        self._next_unit = 0  # the index of the next unit planned

    def _skippable(self) -> dict[int, WindowPlan]:
        """Journal windows whose every unit is committed, by their first record."""
        if self.journal is None:
            return {}
        skippable = {}
        for window in self.journal.read().values():
            units = range(window.first_unit, window.first_unit + window.num_units)
            if all(unit_shard_id(i) in self.committed for i in units):
                skippable[window.first_record] = window
        return skippable

    def _items(self, skippable: dict[int, WindowPlan]) -> Iterator[Any]:
        """Blocks of records to tokenize, and a _Skip where a skippable window starts (its records
        are read past)."""
        records = itertools.islice(
            iter_records(self.recipe.data, require_assistant=self.recipe.tokenizer.require_assistant),
            self.recipe.limit,
        )
        block_size = self.recipe.planning.block_records
        block: list[Any] = []
        record_no = 0
        while True:
            skip = skippable.get(record_no)
            if skip is not None:
                if block:
                    yield block
                    block = []
                yield _Skip(skip)
                consumed = sum(1 for _ in itertools.islice(records, skip.num_records))
                if consumed != skip.num_records:
                    raise ExtractionError(
                        f"plan journal window {skip.index} covers records {skip.first_record}.."
                        f"{skip.first_record + skip.num_records - 1} but the data ends at record "
                        f"{record_no + consumed}: the data changed; write to a new store"
                    )
                record_no += consumed
                continue
            item = next(records, None)
            if item is None:
                break
            block.append(item)
            record_no += 1
            if len(block) >= block_size:
                yield block
                block = []
        if block:
            yield block

    def windows(self) -> Iterator[WindowPlan]:
        """Every window in order. Fresh windows are journaled (with a journal) before being yielded."""
        self._seen, self._next_unit = {}, 0
        window = WindowPlan(index=0, first_record=0)
        pending: list[TokenizedSample] = []  # the open window's accepted samples, input order
        try:
            for item in self.block_tokenizer.map(self._items(self._skippable())):
                if isinstance(item, _Skip):
                    yield self._replay(item.window, window)
                    window = _window_after(item.window)
                    continue
                for result in item:
                    if not self._accept(window, result):
                        continue
                    pending.append(result)
                    if window_is_full(window.num_tokens, self.recipe.units):
                        yield self._close(window, pending)
                        pending = []
                        window = _window_after(window)
            if window.num_records:
                yield self._close(window, pending)
        finally:
            self.block_tokenizer.close()

    def _accept(self, window: WindowPlan, result: TokenizedSample | Rejection) -> bool:
        """Count one tokenized record into ``window``; True when it is an accepted sample (a
        rejection, or a duplicate of an earlier sample, is counted as rejected)."""
        window.num_records += 1
        if isinstance(result, TokenizedSample) and result.sample_id in self._seen:
            result = duplicate_rejection(result, self._seen[result.sample_id])
        if isinstance(result, Rejection):
            window.rejections.append(result)
            self.rejected[str(result.reason)] += 1
            return False
        self._seen[result.sample_id] = result.origin
        window.samples.append((result.sample_id, result.origin))
        window.num_samples += 1
        window.num_tokens += result.num_tokens
        window.num_loss_tokens += int(result.loss_mask.sum())
        window.num_truncated += int(result.truncated)
        return True

    def _close(self, window: WindowPlan, samples: list[TokenizedSample]) -> WindowPlan:
        """Cut the window's samples into units (units.cut_window), journal it."""
        window.first_unit = self._next_unit
        window.units = cut_window(
            samples, self.recipe.units, self._next_unit, origins=[sample.origin for sample in samples]
        )
        window.num_units = len(window.units)
        self._next_unit += window.num_units
        if self.journal is not None:
            self.journal.write(window)
        return window

    def _replay(self, replayed: WindowPlan, open_window: WindowPlan) -> WindowPlan:
        """A journal window whose units are all committed: its counts and sample ids taken as
        journaled (its records were read past, untokenized)."""
        if open_window.num_records:
            raise ExtractionError(
                f"plan journal window {replayed.index} starts at record "
                f"{replayed.first_record}, inside a window planned now: the plan "
                f"changed; remove the store's {JOURNAL_DIR} folder to plan afresh"
            )
        if replayed.first_unit != self._next_unit:
            raise ExtractionError(
                f"plan journal window {replayed.index} starts at unit {replayed.first_unit}, "
                f"expected {self._next_unit}; remove the store's {JOURNAL_DIR} folder to plan afresh"
            )
        self._seen.update(dict(replayed.samples))
        self._next_unit += replayed.num_units
        self.rejected.update(str(r.reason) for r in replayed.rejections)
        return replayed


def _window_after(window: WindowPlan) -> WindowPlan:
    """The empty window that starts where ``window`` ends."""
    return WindowPlan(index=window.index + 1, first_record=window.first_record + window.num_records)


def duplicate_rejection(sample: TokenizedSample, first_origin: str) -> Rejection:
    """The one duplicate rule: a sample whose id (content + tokenization) was seen is rejected,
    naming the record that was kept."""
    return Rejection(
        RejectReason.DUPLICATE,
        f"{sample.origin}: same content as {first_origin} (sample_id {sample.sample_id}); kept the first",
        sample.origin,
        sample.source_id,
        sample.excerpt,
    )
