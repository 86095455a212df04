"""Issue 32.1: extraction on a real three-node Ray cluster on this machine (tests/support/
ray_cluster.py: ``ray start --head`` and two ``ray start --address ...`` worker nodes, each its own
raylet and object store), into an ``s3://`` store on moto's S3 server (its own process, 10 ms per
request). The driver is a process of its own attached with the recipe's ``ray.address``; the actors
need an ``extract_node`` resource that only the worker nodes have.

One unbroken run is the reference; then a worker node is SIGKILLed mid-run (the run finishes on
the other node), the node comes back (a rerun commits nothing twice), and the driver is SIGKILLed
mid-run (a rerun resumes from the committed units). Each end state must verify without findings
and hold exactly the reference's samples: ids, token counts and feature bytes
(:func:`store_content`).
"""

from __future__ import annotations

import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsstore.verify import verify_store
from tests.support.ray_cluster import ClusterRun, LocalRayCluster

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


# Per request, as a distant endpoint adds: each unit's shard write (tens of requests) then takes
# long enough that a node killed after the first commit still had units to run (on loopback with
# no latency the last units were done before the kill landed).
S3_LATENCY_MS = 10


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """moto's S3 server in its own process (tests/support/s3.py), with per-request latency."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.support.s3 import MotoS3

    with MotoS3(latency_ms=S3_LATENCY_MS) as server:
        yield server


@pytest.fixture(scope="module")
def cluster_once(s3: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """Head plus two worker nodes; every node holds the S3 endpoint and keys in its environment,
    as every machine of a real cluster must (the actors write the shards)."""
    pytest.importorskip("ray")
    # A short folder of its own: Ray's unix sockets live under it (paths of at most ~107 bytes).
    root = Path(f"/tmp/hsrc-{uuid.uuid4().hex[:8]}")
    with LocalRayCluster(root, env=s3.environ()) as cluster:
        cluster.add_nodes(2, num_cpus=2, resources={"extract_node": 2})
        yield cluster
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(cluster_once: LocalRayCluster) -> LocalRayCluster:
    """The module's cluster with all three nodes alive (a test that killed one restarts it)."""
    for node in cluster_once.workers:
        if not node.alive:
            cluster_once.restart_node(node)
    return cluster_once


@pytest.fixture(scope="module")
def unbroken(
    s3: Any, cluster_once: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference: a run that never failed, its summary and its store's content."""
    run = ClusterRun(s3.endpoint, s3.environ(), cluster_once, tmp_path_factory.mktemp("unbroken"))
    summary = run.extract()
    assert verify_store(run.location) == []
    return summary, run.content()


def test_extraction_spreads_over_the_worker_nodes(unbroken, cluster):
    summary, content = unbroken
    assert summary["num_units"] >= 4 and summary["num_samples_written"] == summary[
        "num_samples"
    ] == len(content)
    assert sum(n for n, _ in content.values()) == summary["num_tokens"]
    # Both worker nodes' actors committed units; the head (no extract_node resource) none.
    worker_ids = cluster.worker_node_ids("extract_node")
    assert set(summary["units_by_node"]) == set(worker_ids), (summary["units_by_node"], worker_ids)
    assert sum(summary["units_by_node"].values()) == summary["num_units"]


def test_a_worker_node_killed_mid_run_then_back_leaves_the_unbroken_store(
    unbroken, s3, cluster, tmp_path
):
    reference_summary, reference = unbroken
    run = ClusterRun(s3.endpoint, s3.environ(), cluster, tmp_path)
    driver = run.start()
    committed = run.wait_for_commits(1, driver)
    victim, survivor = cluster.workers
    victim_id, survivor_id = cluster.ray_node_id(victim), cluster.ray_node_id(survivor)
    cluster.kill_node(victim)  # its raylet, object store and actor, SIGKILLed together
    # A unit counts for the node whose result reached the driver, after its commit: whatever the
    # victim is credited with was committed before it died, so it is in this listing.
    committed_at_kill = len(run.committed_ids())
    summary = run.finish(driver)  # the actor restarts on the other node, its units retried there
    assert len(committed) < reference_summary["num_units"], "the kill landed after the last commit"
    # The victim's actor was restarted on the survivor, which ran every unit from then on (how
    # many the victim ran before that depends on the machine's load, not on the recovery).
    by_node = summary["units_by_node"]
    assert (
        set(by_node) <= {victim_id, survivor_id} and sum(by_node.values()) == summary["num_units"]
    )
    assert by_node.get(victim_id, 0) <= committed_at_kill, (by_node, committed_at_kill)
    assert by_node[survivor_id] >= summary["num_units"] - committed_at_kill, (by_node, committed_at_kill)
    assert verify_store(run.location) == []
    assert run.content() == reference

    # The node comes back; a rerun finds every unit committed and commits nothing twice.
    cluster.restart_node(victim)
    shards = run.shards()
    again = run.extract()
    assert again["num_samples_written"] == 0 and again["num_units_skipped"] == again["num_units"]
    assert run.shards() == shards
    assert verify_store(run.location) == []
    assert run.content() == reference


def test_a_driver_killed_mid_run_is_resumed_by_a_rerun(unbroken, s3, cluster, tmp_path):
    reference_summary, reference = unbroken
    run = ClusterRun(s3.endpoint, s3.environ(), cluster, tmp_path)
    driver = run.start()
    run.wait_for_commits(1, driver)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    committed = {s.shard_id: s for s in run.shards()}
    assert 1 <= len(committed) < reference_summary["num_units"], (
        "the kill landed after the last commit"
    )

    summary = run.extract()
    assert summary["num_units_skipped"] == len(committed)
    assert summary["num_samples_written"] == reference_summary["num_samples"] - sum(
        s.num_samples for s in committed.values()
    )
    shards = run.shards()
    assert len({s.shard_id for s in shards}) == len(shards) == reference_summary["num_units"]
    assert all(
        committed[s.shard_id] == s for s in shards if s.shard_id in committed
    )  # kept as they were
    assert verify_store(run.location) == []
    assert run.content() == reference
