"""The loader's read schedule by location (hsstore.read_schedule): units, groups in flight, pools."""

from __future__ import annotations

import threading
from pathlib import Path

from hsstore.read_schedule import ReadSchedule, started_pool
from hsstore.storage import StoreLocation


def test_object_storage_reads_each_feature_alone_and_the_whole_read_ahead_in_flight(tmp_path: Path) -> None:
    features = ["aux_hidden_states", "final_hidden_state"]
    local = ReadSchedule.for_location(StoreLocation(str(tmp_path)), features, prefetch_batches=8)
    assert local == ReadSchedule([features], group_size=4, groups_in_flight=2, open_ahead=False)
    remote = ReadSchedule.for_location(StoreLocation("memory://schedule/store"), features, prefetch_batches=8)
    assert remote == ReadSchedule([[name] for name in features], group_size=1, groups_in_flight=8, open_ahead=True)
    assert ReadSchedule.for_location(StoreLocation(str(tmp_path)), features, prefetch_batches=1).group_size == 1


def test_a_started_pool_has_every_thread_running_before_its_first_task() -> None:
    pool = started_pool(12, "hsstore-test-started")
    try:
        running = [t for t in threading.enumerate() if t.name.startswith("hsstore-test-started")]
        assert len(running) == 12
        assert pool.submit(lambda: 7).result(timeout=10) == 7
    finally:
        pool.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("hsstore-test-started")]
