"""Several committers on one store at once: nothing committed is ever lost.

The decision (docs/reliability.md): two jobs pointed at one store both succeed, without loss. A
commit is a read-merge-write of ``manifest.json`` that skips shard ids already committed, and each
backend serialises it: ``flock`` locally, a conditional PUT (If-Match / If-None-Match) on S3, an
in-process lock on ``memory://``. These tests race real committers on all three and check the end
state exactly (shard ids, sample ids, ``verify``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import hsstore
from hsstore import CommitConflictError, StoreLocation
from hsstore.commit import MANIFEST_NAME
from hsstore.verify import verify_store
from tests.support.paths import REPO_ROOT
from tests.support.stores import make_lineage, make_sample, make_specs

pytestmark = pytest.mark.reliability

SAMPLES_PER_SHARD = 3


def shard_samples(unit: int) -> range:
    return range(unit * SAMPLES_PER_SHARD, unit * SAMPLES_PER_SHARD + SAMPLES_PER_SHARD)


def write_and_commit(url: str, units: list[int], options: dict | None = None) -> None:
    """One committer: a shard per unit, committed as soon as it is written (as the driver does)."""
    specs, lineage = make_specs(), make_lineage()
    for unit in units:
        writer = hsstore.ShardWriter(url, f"unit-{unit:03d}", specs, storage_options=options)
        for index in shard_samples(unit):
            writer.add_sample(**make_sample(index, 7))
        hsstore.commit_shards(url, [writer.finish()], features=specs, lineage=lineage, storage_options=options)


def assert_store_holds(url: str, units: set[int], options: dict | None = None) -> None:
    store = hsstore.open_store(url, storage_options=options)
    assert {s.shard_id for s in store.shards} == {f"unit-{u:03d}" for u in units}
    expected = {f"sample-{i:05d}" for u in units for i in shard_samples(u)}
    ids = store.samples.column("sample_id").to_pylist()
    assert len(ids) == len(expected) and set(ids) == expected
    fatal = [str(p) for p in verify_store(StoreLocation(url, options)) if p.fatal]
    assert fatal == []


def race_in_threads(url: str, plans: list[list[int]], options: dict | None = None) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(plans))

    def run(units: list[int]) -> None:
        try:
            barrier.wait()
            write_and_commit(url, units, options)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []


# Four committers; every unit is written by two of them (as a retried Ray task or a second job
# would), so both the merge and the first-attempt-wins rule are exercised.
PLANS = [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8], [6, 7, 8, 9, 10, 11], [9, 10, 11, 0, 1, 2]]


def test_racing_committers_in_threads_on_memory_lose_nothing(memory_url):
    race_in_threads(memory_url, PLANS)
    assert_store_holds(memory_url, set(range(12)))


def test_racing_committers_in_threads_on_s3_lose_nothing(s3_store, caplog):
    url, options = s3_store
    caplog.set_level("INFO", logger="hsstore.commit")  # where commit conflicts are logged
    race_in_threads(url, PLANS, options)
    assert_store_holds(url, set(range(12)), options)
    conflicts = sum("manifest commit conflict" in r.getMessage() for r in caplog.records)
    print(f"S3 conditional-PUT conflicts retried: {conflicts}")


COMMITTER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from tests.reliability.test_concurrent_commits import write_and_commit
    write_and_commit(sys.argv[1], [int(u) for u in sys.argv[2].split(",")])
    """
)


def test_racing_committer_processes_on_a_local_store_lose_nothing(tmp_path):
    url = str(tmp_path / "store")
    script = COMMITTER.format(repo=str(REPO_ROOT))
    processes = [
        subprocess.Popen([sys.executable, "-c", script, url, ",".join(map(str, plan))]) for plan in PLANS
    ]
    assert [p.wait(timeout=180) for p in processes] == [0] * len(PLANS)
    assert_store_holds(url, set(range(12)))


def test_a_stale_conditional_put_is_refused_by_the_s3_server(s3_store):
    url, options = s3_store
    location = StoreLocation(url, options)
    write_and_commit(url, [0], options)
    data, etag = location.read_bytes_versioned(MANIFEST_NAME)
    write_and_commit(url, [1], options)  # another committer moves the manifest on
    with pytest.raises(CommitConflictError, match=r"changed since it was read \(conditional PUT refused\)"):
        location.write_bytes_if(MANIFEST_NAME, data, etag)
    with pytest.raises(CommitConflictError, match=r"changed since it was read \(conditional PUT refused\)"):
        location.write_bytes_if(MANIFEST_NAME, data, None)  # create-only, but it exists
    assert_store_holds(url, {0, 1}, options)


HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from hsstore import StoreLocation
    with StoreLocation(sys.argv[1]).commit_lock():
        print("locked", flush=True)
        time.sleep(600)
    """
)


def test_a_committer_killed_holding_the_lock_blocks_nobody(tmp_path):
    url = str(tmp_path / "store")
    write_and_commit(url, [0])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(repo=str(REPO_ROOT)), url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        # Alive, it holds the store: a short wait times out with a message naming the lock file.
        with (
            pytest.raises(CommitConflictError, match=r"manifest\.lock: another process has been committing"),
            StoreLocation(url).commit_lock(timeout_s=0.3),
        ):
            pass
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        start = time.monotonic()
        write_and_commit(url, [1])
        # The kernel dropped the dead holder's lock: no 60 s stale-lock wait.
        assert time.monotonic() - start < 10
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert_store_holds(url, {0, 1})
    assert (Path(url) / "manifest.lock").read_text().strip() == str(os.getpid())


@pytest.mark.parametrize("codec,compression", [("bf16", "none"), ("fp8_e4m3", "zstd")])
def test_store_round_trip_contract_on_s3(s3_store, codec, compression):
    """The store contract (tests/hsstore/test_store.py) on an S3-compatible endpoint."""
    import numpy as np
    import torch

    from tests.support.stores import write_store

    url, options = s3_store
    samples = write_store(url, num_samples=10, shard_max_tokens=60, codec=codec, compression=compression, storage_options=options)
    store = hsstore.open_store(url, storage_options=options)
    assert store.num_samples == 10 and len(store.shards) > 1
    assert store.num_tokens == sum(len(s["input_ids"]) for s in samples)
    for index, sample in enumerate(samples):
        got = store.read_sample(index)
        assert got["sample_id"] == sample["sample_id"]
        np.testing.assert_array_equal(got["input_ids"].numpy(), sample["input_ids"])
        for name, values in sample["features"].items():
            expected = torch.from_numpy(values).to(torch.bfloat16).float()
            if codec == "bf16":
                assert torch.equal(got[name].float(), expected)
            else:
                bound = np.abs(values) * (2**-4 + 2**-7) + np.abs(values).max(axis=-1, keepdims=True) / 448 * 2**-9 + 1e-6
                assert np.all(np.abs(got[name].float().numpy() - values) <= bound)
    assert store.verify() == []
    # Resume on S3: the same shard id again is skipped, nothing is duplicated.
    first = store.shards[0]
    again = hsstore.commit_shards(url, [first], features=make_specs(codec, compression), lineage=make_lineage(), storage_options=options)
    assert again.generation == store.manifest.generation and again.num_samples == 10
