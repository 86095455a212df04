"""How the streaming loader schedules its reads, by where the store is.

- **Locally** a read is a sample (its arrays one ``preadv`` each), batches are read in two groups of
  half the read-ahead (one read while the other is consumed), and 4 threads keep a disk busy.
- **Where requests wait on a network** (``StoreLocation.prefers_threads``: object storage) a read is
  a sample's feature, so that each GET is a read in flight of its own instead of a sample's arrays
  waiting on one another in one thread; batches are read one per group with the whole read-ahead in
  flight, the next batch's reads starting as soon as the oldest batch is handed over (between groups
  of several batches the reads in flight drained to the group's last few); and the location's read
  threads (64 on object storage, ``hsstore.storage.base``) hide its latency.

Thread pools start all their threads before the first read (:func:`started_pool`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hsstore.storage.base import StoreLocation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadSchedule:
    """The units, groups and batches in flight of one loader's reads (see the module doc)."""

    read_units: list[list[str]]  # the features one read task reads, together
    group_size: int  # batches per read group
    groups_in_flight: int  # groups read ahead, the oldest one being consumed
    open_ahead: bool  # fetch a group's shards' first-use files at once, ahead of its reads

    @classmethod
    def for_location(cls, location: StoreLocation, features: Sequence[str], prefetch_batches: int) -> ReadSchedule:
        if location.prefers_threads:
            return cls([[name] for name in features], 1, prefetch_batches, open_ahead=True)
        return cls([list(features)], max(1, prefetch_batches // 2), 2, open_ahead=False)


def started_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are all running. A pool starts a thread per submit until it has
    its count, and each start waits for the new thread to take the GIL: started in the middle of a
    burst of submits, with other read threads busy, 64 of them held the submitting thread for
    ~0.4 s on 2 loaded cores (the first batch waited on it); started here, before any read, ~10 ms."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
    ready = threading.Barrier(threads + 1, timeout=30)
    for _ in range(threads):
        pool.submit(ready.wait)  # busy until all are started, so each submit starts a new thread
    try:
        ready.wait()
    except threading.BrokenBarrierError:  # a thread did not start in time: the pool starts it later
        logger.debug("%s: not all %d threads started", name, threads)
    return pool
