"""Deterministic, resumable streaming of packed batches from a store.

The plan (which samples go into which row of which batch, per rank and epoch) comes from
:mod:`hsstore.packing` and is a pure function of the seed, the epoch, the manifest's shard list and
the sample lengths; this module executes it:

- **Reads** go straight into the batch: the buffers of a few upcoming batches are taken from a pool
  (:class:`hsstore.batches.BatchBufferPool`; a batch gives its buffers back when the consumer calls
  :meth:`HostBatch.release`, or :func:`hsstore.torch_data.to_device` once it has copied them to a
  GPU) and each sample's token range is read into its place (:meth:`Store.read_token_range` with ``out=``, one
  ``preadv`` per array, crc32c-checked), ``read_threads`` reads in flight, ahead of the consumer.
- **Bits stay bits** on the host: bf16 as uint16, fp8 as uint8 plus float32 scales. Decoding happens
  in :func:`hsstore.torch_data.to_device` on the training device (a bf16 view, or an fp8 cast times
  the scale), so the host moves half (bf16) or a quarter (fp8) of the float32 bytes.
- **Resume** needs only :class:`LoaderState` (a few scalars): a batch carries its ``(epoch, index)``,
  the consumer records the position after the last batch it used, and restarting from that state
  yields exactly the batches an uninterrupted run would have seen next.
- **Workers** (DataLoader processes) are served by :mod:`hsstore.torch_data`: each opens the store
  itself and calls :meth:`StreamingLoader.batches` with its ``worker_id``/``num_workers`` stride.

Importing this module does not import torch; the functions that return tensors import it. The
torch-facing half (``DeviceBatch``, ``to_device``, ``StoreBatchDataset``, ``make_dataloader``,
``WaitTimer``) lives in :mod:`hsstore.torch_data`, which imports this module (never the reverse).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np

from hsstore.batches import BatchBufferPool, BatchPosition, HostBatch, LoaderState
from hsstore.catalog import OPEN_AHEAD_THREADS, build_catalog
from hsstore.errors import ShardCorruptError
from hsstore.format.features import FeatureSpec
from hsstore.format.layout import TABLE_FEATURES
from hsstore.host_decode import HostDecoder
from hsstore.packing import (
    EpochPlan,
    LoaderError,
    LongSamples,
    Remainder,
    layout_rows,
    plan_epoch,
)
from hsstore.read_cache import ReadCache
from hsstore.read_schedule import ReadSchedule, started_pool
from hsstore.store import Store, open_store

logger = logging.getLogger(__name__)

# (epoch, batch index, rows of global sample indices): one batch of a read group.
_GroupItem = tuple[int, int, list[np.ndarray]]
# (epoch, batch index, rows of sample indices, feature buffers being read into)
_PlannedBatch = tuple[int, int, list[list[int]], dict[str, np.ndarray]]
# (position of its batch in the group, sample, the read in flight)
_Read = tuple[int, int, Future[None]]


class StreamingLoader:
    """Packed batches of one rank, epoch after epoch, read from ``store``.

    ``features`` names the stored features to read (``input_ids``/``loss_mask`` always come along).
    See the module doc for the reading strategy and :mod:`hsstore.packing` for the order.
    """

    def __init__(
        self,
        store: Store | str,
        features: Sequence[str],
        *,
        token_budget: int,
        rows_per_batch: int = 1,
        seed: int = 0,
        shuffle_window: int = 1024,
        rank: int = 0,
        world_size: int = 1,
        remainder: Remainder = "drop",
        long_samples: LongSamples = "error",
        read_threads: int | None = None,
        prefetch_batches: int | None = None,
        skip_corrupt: bool = False,
        decode_on_host: bool = False,
        storage_options: dict[str, Any] | None = None,
        cache: ReadCache | None = None,
        layers: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """``storage_options``, ``cache``: for a URL (:func:`open_store`); a cache is attached to a
        given Store. ``layers``: leading indices to read per feature (``{"aux_hidden_states": [0, 2]}``,
        see :func:`hsstore.aux_layers.select_aux_layers`); batches hold only those.
        ``read_threads``, ``prefetch_batches``: reads in flight, batches read ahead (defaults from the
        store's backend: more on object storage)."""
        self.store: Store = store if isinstance(store, Store) else open_store(store, storage_options=storage_options, cache=cache)
        self.store.cache = cache or self.store.cache
        self.features = [name for name in features if name not in TABLE_FEATURES]
        missing = [name for name in self.features if name not in self.store.features]
        if missing:
            raise LoaderError(
                f"{self.store.url}: no feature(s) {missing}; the store holds {sorted(self.store.features)}")
        self.token_budget = token_budget
        self.rows_per_batch = rows_per_batch
        self.seed = seed
        self.shuffle_window = shuffle_window
        self.rank = rank
        self.world_size = world_size
        self.remainder: Remainder = remainder
        self.long_samples: LongSamples = long_samples
        for name, value in (("read_threads", read_threads), ("prefetch_batches", prefetch_batches)):
            if value is not None and value < 1:
                raise LoaderError(f"{name} must be >= 1, got {value}")
        self.read_threads = read_threads or self.store.location.read_threads
        self.prefetch_batches = prefetch_batches or self.store.location.prefetch_batches
        self.skip_corrupt = skip_corrupt
        self.decode_on_host = decode_on_host
        # Fixed for the loader's life (read per batch): the features as stored, as batches hold
        # them, and the fp8 ones the readers decode to bf16 (decode_on_host).
        self.layers = {name: [int(i) for i in chosen] for name, chosen in (layers or {}).items()}
        if set(self.layers) - set(self.features):
            raise LoaderError(f"layers given for {sorted(self.layers)}, not all among the features read {self.features}")
        try:
            self._stored_specs = {name: self.store.feature_spec(name, self.layers) for name in self.features}
        except ValueError as err:
            raise LoaderError(f"{self.store.url}: {err}") from err
        self._decoded_here = {
            name: spec for name, spec in self._stored_specs.items() if decode_on_host and spec.codec == "fp8_e4m3"
        }
        self._specs = {
            name: spec.model_copy(update={"codec": "bf16"}) if name in self._decoded_here else spec
            for name, spec in self._stored_specs.items()
        }
        self._host_decoder = HostDecoder(self.store, self._decoded_here)
        # Batch buffers, recycled when a batch is released (HostBatch.release); enough free sets for
        # the batches in flight and one being consumed.
        arrays = [array for spec in self._specs.values() for array in spec.stored_arrays()]
        self._buffers = BatchBufferPool(arrays, token_budget, max_free=self.prefetch_batches + 2)
        self._catalog = build_catalog(self.store)
        self._schedule = ReadSchedule.for_location(self.store.location, self.features, self.prefetch_batches)
        self._plans: dict[int, EpochPlan] = {}
        self._plans_lock = threading.Lock()
        self.num_skipped_samples = 0

    # -- the plan ----------------------------------------------------------------------------

    @property
    def stored_specs(self) -> dict[str, FeatureSpec]:
        """The features read, as the store keeps them."""
        return dict(self._stored_specs)

    @property
    def specs(self) -> dict[str, FeatureSpec]:
        """The features as batches hold them (what :func:`to_device` needs): the stored codecs, or
        with ``decode_on_host`` fp8 features as bf16 bits (decoded by the loader)."""
        return dict(self._specs)

    @property
    def num_samples(self) -> int:
        return len(self._catalog.num_tokens)

    def plan(self, epoch: int) -> EpochPlan:
        """This rank's plan for ``epoch`` (cached: the two most recent epochs)."""
        with self._plans_lock:
            plan = self._plans.get(epoch)
        if plan is None:
            plan = plan_epoch(
                self._catalog.shard_sample_counts,
                self._catalog.num_tokens,
                seed=self.seed,
                epoch=epoch,
                token_budget=self.token_budget,
                rows_per_batch=self.rows_per_batch,
                shuffle_window=self.shuffle_window,
                rank=self.rank,
                world_size=self.world_size,
                remainder=self.remainder,
                long_samples=self.long_samples,
                sample_names=self._catalog.sample_names,
            )
            with self._plans_lock:
                if len(self._plans) >= 2:
                    self._plans.pop(min(self._plans))
                self._plans[epoch] = plan
        return plan

    def num_batches(self, epoch: int) -> int:
        """Steps this rank (and every other rank) takes in ``epoch``."""
        return self.plan(epoch).num_batches

    def initial_state(self) -> LoaderState:
        return LoaderState(
            seed=self.seed,
            world_size=self.world_size,
            token_budget=self.token_budget,
            rows_per_batch=self.rows_per_batch,
            shuffle_window=self.shuffle_window,
            num_samples=self.num_samples,
        )

    def state_after(self, batch: BatchPosition) -> LoaderState:
        """The state to save once ``batch`` has been used: resuming from it yields the next batch."""
        nxt = batch.index + 1
        if nxt >= self.num_batches(batch.epoch):
            return self._with_position(batch.epoch + 1, 0)
        return self._with_position(batch.epoch, nxt)

    def _with_position(self, epoch: int, batch_in_epoch: int) -> LoaderState:
        return LoaderState(**{**self.initial_state().to_dict(), "epoch": epoch, "batch_in_epoch": batch_in_epoch})

    def check_state(self, state: LoaderState) -> None:
        """Refuse a state saved under settings that would give another sequence of batches."""
        expected = self.initial_state().to_dict()
        found = state.to_dict()
        for key in ("seed", "world_size", "token_budget", "rows_per_batch", "shuffle_window", "num_samples"):
            if expected[key] != found[key]:
                raise LoaderError(
                    f"cannot resume: the saved loader state has {key}={found[key]} but this run has "
                    f"{key}={expected[key]}; the batch sequence would differ from the interrupted run"
                )

    def positions(self, start: LoaderState, max_epochs: int | None = None) -> Iterator[tuple[int, int]]:
        """(epoch, batch index) of the rank's stream from ``start`` on."""
        epoch, index = start.epoch, start.batch_in_epoch
        while max_epochs is None or epoch < max_epochs:
            count = self.num_batches(epoch)
            for j in range(index, count):
                yield epoch, j
            epoch, index = epoch + 1, 0

    # -- reading -----------------------------------------------------------------------------

    def batches(
        self,
        start: LoaderState | None = None,
        *,
        max_epochs: int | None = None,
        worker_id: int = 0,
        num_workers: int = 1,
    ) -> Iterator[HostBatch]:
        """The rank's batches from ``start`` (default: the beginning), reading ahead in threads.

        With ``num_workers > 1`` this yields only the batches of ``worker_id`` (every
        ``num_workers``-th one counting from ``start``).
        """
        start = start or self.initial_state()
        self.check_state(start)
        mine = (
            pos
            for k, pos in enumerate(self.positions(start, max_epochs))
            if k % num_workers == worker_id
        )
        schedule = self._schedule  # units, groups in flight: hsstore.read_schedule
        readers = started_pool(self.read_threads, "hsstore-read")
        assembler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsstore-assemble")
        # A group's shards' table, zarr.json and index fetched at once (SampleCatalog.open_ahead).
        opener = started_pool(OPEN_AHEAD_THREADS, "hsstore-open") if schedule.open_ahead else None
        pending: deque[Future[list[HostBatch]]] = deque()
        first = True
        try:
            while True:
                group = [  # the first group is one batch: step 1 waits for one batch's reads
                    (epoch, j, self.plan(epoch).batches[j])
                    for _, (epoch, j) in zip(range(1 if first else schedule.group_size), mine, strict=False)
                ]
                if group and opener is not None:
                    samples = [int(s) for _, _, rows in group for row in rows for s in row]
                    self._catalog.open_ahead(samples, self.features, self.layers, opener)
                if group:
                    planned, reads = self._start_group(group, readers)
                    pending.append(assembler.submit(self._finish_group, planned, reads))
                    if first:  # the first batch read alone: no later group's GETs share the endpoint with it
                        futures_wait(pending)
                first = False
                if not pending:
                    return
                # Keep the other groups reading while the oldest is consumed.
                if len(pending) >= schedule.groups_in_flight or not group:
                    yield from pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            assembler.shutdown(wait=True, cancel_futures=True)
            readers.shutdown(wait=True, cancel_futures=True)
            if opener is not None:
                opener.shutdown(wait=True, cancel_futures=True)

    def _clipped_length(self, sample: int) -> int:
        return int(min(self._catalog.num_tokens[sample], self.token_budget))

    def _start_group(self, group: list[_GroupItem], pool: ThreadPoolExecutor) -> tuple[list[_PlannedBatch], list[_Read]]:
        """Allocate the group's batches and start reading every sample straight into its place
        (one read per ``ReadSchedule.read_units`` entry): :meth:`Store.read_token_range` scatters
        the rows into the batch buffer with one ``preadv`` or streamed GET per array, so the bytes are
        copied once, into the batch, instead of into a range buffer first."""
        batches: list[_PlannedBatch] = []
        reads: list[_Read] = []
        for n, (epoch, j, planned) in enumerate(group):
            rows = [[int(s) for s in row] for row in planned]
            arrays = self._buffers.take([sum(self._clipped_length(s) for s in row) for row in rows])
            for b, row in enumerate(rows):
                cursor = 0
                for s in row:
                    length = self._clipped_length(s)
                    out = {key: array[b, cursor : cursor + length] for key, array in arrays.items()}
                    for features in self._schedule.read_units:
                        reads.append((n, s, pool.submit(self._read_into, s, length, out, features)))
                    cursor += length
            batches.append((epoch, j, rows, arrays))
        return batches, reads

    def _read_into(self, sample: int, length: int, out: dict[str, np.ndarray], features: list[str]) -> None:
        shard_id, offset = self._catalog.locate(sample)
        if self._decoded_here:
            self._host_decoder.read(shard_id, offset, length, features, out, self.layers)
        else:
            self.store.read_token_range(shard_id, offset, offset + length, features, out=out, layers=self.layers)

    def _finish_group(self, batches: list[_PlannedBatch], reads: list[_Read]) -> list[HostBatch]:
        """Wait for the group's reads and complete its batches (token columns, document layout)."""
        started = time.perf_counter()
        failed: dict[int, set[int]] = {}  # batch position in the group -> samples that did not read
        for n, s, future in reads:
            try:
                future.result()
            except (ShardCorruptError, OSError) as err:
                name = self._catalog.sample_names[s]
                if not self.skip_corrupt:
                    raise ShardCorruptError(
                        f"reading sample {name} failed: {err} "
                        "(set skip_corrupt to skip unreadable samples and count them)"
                    ) from err
                logger.warning("skipping sample %s: %s", name, err)
                failed.setdefault(n, set()).add(s)
        wait_s = time.perf_counter() - started
        bytes_per_token = sum(spec.raw_bytes_per_token for spec in self._stored_specs.values())
        out = []
        for n, (epoch, j, rows, arrays) in enumerate(batches):
            skipped = failed.get(n, set())
            num_planned = sum(len(row) for row in rows)
            if skipped:
                rows, arrays = self._without(rows, arrays, skipped)
                self.num_skipped_samples += num_planned - sum(len(row) for row in rows)
            layout = layout_rows([[self._clipped_length(s) for s in row] for row in rows], self.token_budget)
            shape = (len(rows), self.token_budget)
            input_ids = np.zeros(shape, dtype=np.int64)
            loss_mask = np.zeros(shape, dtype=np.uint8)
            for b, row in enumerate(rows):
                cursor = 0
                for s in row:
                    length = self._clipped_length(s)
                    ids, mask = self._catalog.sample_tokens(s, length)
                    input_ids[b, cursor : cursor + length] = ids
                    loss_mask[b, cursor : cursor + length] = mask
                    cursor += length
            out.append(
                HostBatch(
                    epoch=epoch,
                    index=j,
                    input_ids=input_ids,
                    loss_mask=loss_mask,
                    position_ids=layout.position_ids,
                    doc_ids=layout.doc_ids,
                    doc_remaining=layout.doc_remaining,
                    doc_lengths=layout.doc_lengths,
                    sample_indices=rows,
                    features=arrays,
                    _release=self._buffers.releaser(arrays),
                    num_real_tokens=layout.num_real_tokens,
                    num_skipped_samples=num_planned - sum(len(row) for row in rows),
                    read_seconds=wait_s if n == 0 else 0.0,  # the group's, on its first batch
                    bytes_read=layout.num_real_tokens * bytes_per_token,
                )
            )
        return out

    def _without(
        self, rows: list[list[int]], arrays: dict[str, np.ndarray], skipped: set[int]
    ) -> tuple[list[list[int]], dict[str, np.ndarray]]:
        """The batch with the unreadable samples taken out: the rest move up within their row."""
        kept = [[s for s in row if s not in skipped] for row in rows]
        packed = self._buffers.take([sum(self._clipped_length(s) for s in row) for row in kept])
        for b, row in enumerate(rows):
            source = target = 0
            for s in row:
                length = self._clipped_length(s)
                if s not in skipped:
                    for key, array in arrays.items():
                        packed[key][b, target : target + length] = array[b, source : source + length]
                    target += length
                source += length
        self._buffers.give_back(arrays)  # nobody else has seen the unpacked batch
        return kept, packed


__all__ = ["BatchPosition", "HostBatch", "LoaderError", "LoaderState", "StreamingLoader"]
