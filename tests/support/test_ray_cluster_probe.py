"""The cluster tests' node probe (tests/support/ray_cluster.py): a question it cannot answer in time
is an error that a waiting caller retries, and the probe is gone once closed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.ray_cluster import ClusterError, _free_ports, _NodeProbe


def test_a_probe_with_no_cluster_behind_it_times_out_and_closes(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    address = f"127.0.0.1:{_free_ports(1)[0]}"  # nothing listens there: ray.init keeps retrying
    probe = _NodeProbe(address, dict(os.environ), tmp_path / "probe.log")
    try:
        with pytest.raises(ClusterError, match="the node probe gave no answer in 1 s"):
            probe.nodes(timeout_s=1.0)
        assert probe.alive
    finally:
        probe.close()
    assert not probe.alive and probe.process.returncode is not None
