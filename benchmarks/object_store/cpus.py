"""Whose cores a loopback S3 benchmark runs on, and how busy they were (Linux).

On loopback the endpoint (moto's server processes) and its client share one machine's cores. A
client that spends CPU on the bytes it receives (the loader copies each body into the batch and
checks every chunk's crc32c) then takes cores from the endpoint it is measured against, which a
client of a real object store, on another machine, never does. ``--endpoint-cpus N`` gives the
endpoint the first ``N`` cores and the client the rest (every thread of each process, and the
threads they start later inherit it), so that both the loader and the bare clients meet an
endpoint of the same capacity; and each run records how busy each side's cores were, which says
which side was the limit.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def split_cpus(endpoint_cpus: int) -> tuple[list[int], list[int]]:
    """The cores this process may use, split: the first ``endpoint_cpus`` for the endpoint, the rest
    for the client; refuses a split that leaves either side none."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < endpoint_cpus < len(cpus):
        raise SystemExit(f"--endpoint-cpus {endpoint_cpus}: this process has {len(cpus)} cores; give the endpoint 1 to {len(cpus) - 1}")
    return cpus[:endpoint_cpus], cpus[endpoint_cpus:]


def process_group(pgid: int) -> list[int]:
    """The processes whose process group is ``pgid`` (the moto server and its forked copies)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # The fields after the command (which may hold spaces) in parentheses: state, ppid, pgrp.
                if int((entry / "stat").read_text().rpartition(")")[2].split()[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


def pin(pids: list[int], cpus: list[int]) -> int:
    """Every thread of the processes ``pids`` onto ``cpus``; returns how many threads were pinned."""
    pinned = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(tid), cpus)
                    pinned += 1
    return pinned


def _cpu_times() -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies of each core since boot, from /proc/stat."""
    times = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            values = [int(value) for value in fields]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


@contextlib.contextmanager
def cpu_use(sides: dict[str, list[int]]) -> Iterator[dict[str, Any]]:
    """Inside the block, how much CPU this process used (``process_cpu_s``, all its threads) and
    how busy each named set of cores was (``busy``: the share of their time not idle, 0-1)."""
    result: dict[str, Any] = {}
    before, usage = _cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
    try:
        yield result
    finally:
        after, used = _cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
        result["process_cpu_s"] = round(used.ru_utime + used.ru_stime - usage.ru_utime - usage.ru_stime, 2)
        busy = {}
        for side, cpus in sides.items():
            spent = sum(after[c][0] - before[c][0] for c in cpus if c in after and c in before)
            total = sum(after[c][1] - before[c][1] for c in cpus if c in after and c in before)
            busy[side] = round(spent / total, 3) if total else None
        result["busy"] = busy
