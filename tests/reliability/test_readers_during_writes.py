"""Several reader processes read a store while a writer adds shards: a reader sees only committed
shards, each complete, never a partial one; what it opened stays readable while commits go on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import hsstore
from hsstore import StoreLocation
from hsstore.verify import verify_store
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.reliability

NUM_UNITS = 14
PER_UNIT = 4

WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    import hsstore
    from tests.support.stores import make_lineage, make_sample, make_specs
    url = sys.argv[1]
    specs, lineage = make_specs(), make_lineage()
    hsstore.ensure_store(url, features=specs, lineage=lineage)
    print("ready", flush=True)
    for unit in range({units}):
        writer = hsstore.ShardWriter(url, f"unit-{{unit:03d}}", specs)
        for index in range(unit * {per}, unit * {per} + {per}):
            writer.add_sample(**make_sample(index, 20 + index % 7))
        hsstore.commit_shards(url, [writer.finish()], features=specs, lineage=lineage)
        time.sleep(0.05)
    """
)

READER = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {repo!r})
    import numpy as np
    import hsstore
    from tests.support.stores import make_sample
    url, deadline = sys.argv[1], time.monotonic() + 120
    generations, problems, samples_read, last_shards = [], [], 0, set()
    while time.monotonic() < deadline:
        store = hsstore.open_store(url)
        shards = {{s.shard_id for s in store.shards}}
        if not last_shards <= shards:
            problems.append(f"shards disappeared: {{sorted(last_shards - shards)}}")
        last_shards = shards
        generations.append(store.manifest.generation)
        for index in range(store.num_samples):
            try:
                got = store.read_sample(index, as_numpy=True)
            except Exception as err:  # a partial shard would show here
                problems.append(f"gen {{store.manifest.generation}} sample {{index}}: {{type(err).__name__}}: {{err}}")
                continue
            number = int(got["sample_id"].split("-")[1])
            want = make_sample(number, 20 + number % 7)
            if not np.array_equal(got["input_ids"], want["input_ids"]):
                problems.append(f"sample {{number}}: wrong input_ids")
            if got["final_hidden_state"].shape != want["features"]["final_hidden_state"].shape:
                problems.append(f"sample {{number}}: wrong feature shape")
            samples_read += 1
        if len(shards) == {units}:
            break
    print(json.dumps({{"generations": generations, "problems": problems, "samples_read": samples_read}}))
    """
)


def test_readers_see_only_committed_complete_shards_while_a_writer_commits(tmp_path):
    url = str(tmp_path / "store")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(repo=str(REPO_ROOT), units=NUM_UNITS, per=PER_UNIT), url],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "ready"
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER.format(repo=str(REPO_ROOT), units=NUM_UNITS), url],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    assert writer.wait(timeout=180) == 0
    reports = []
    for reader in readers:
        out, _ = reader.communicate(timeout=180)
        assert reader.returncode == 0
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for report in reports:
        assert report["problems"] == []
        assert report["generations"] == sorted(report["generations"])  # never back in time
    # The readers really overlapped the writer: together they saw several intermediate states.
    seen = {g for report in reports for g in report["generations"]}
    assert len(seen) >= 3, seen
    store = hsstore.open_store(url)
    assert store.num_samples == NUM_UNITS * PER_UNIT
    assert [p for p in verify_store(StoreLocation(url)) if p.fatal] == []
