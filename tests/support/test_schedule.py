"""The longest-first order of test modules (tests/support/schedule.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.paths import REPO_ROOT
from tests.support.schedule import (
    MODULE_SECONDS,
    longest_modules_first,
    recorded_seconds,
    seconds_from_durations_log,
)


def test_modules_go_longest_first_and_keep_their_tests_in_order() -> None:
    items = [SimpleNamespace(nodeid=n) for n in ("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2")]
    longest_modules_first(items, {"b.py": 30.0, "a.py": 2.5})  # c.py is not recorded: last
    assert [i.nodeid for i in items] == ["b.py::t1", "b.py::t2", "a.py::t1", "a.py::t2", "c.py::t1"]


def test_seconds_are_summed_per_module_from_a_durations_log() -> None:
    log = """============================= slowest durations =============================
12.50s call     tests/x/test_a.py::test_one[param::x]
2.00s setup    tests/x/test_a.py::test_one[param::x]
0.30s teardown tests/x/test_b.py::Klass::test_two
(12 durations < 0.005s hidden.  Use -vv to show these durations.)"""
    assert seconds_from_durations_log(log) == {"tests/x/test_a.py": 14.5, "tests/x/test_b.py": 0.3}


def test_the_recorded_modules_exist() -> None:
    """A renamed or removed module must be renamed or removed in the table too."""
    seconds = recorded_seconds(MODULE_SECONDS)
    assert len(seconds) > 20
    assert [module for module in seconds if not (REPO_ROOT / module).is_file()] == []
