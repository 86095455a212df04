"""``benchmarks/common.py``'s step runner: a step as a process of its own (as on a GPU) and in the
calling process (``STEPS_IN_PROCESS_ENV``, what the smoke tests set) give the same exit code and
output, its log file included."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.common import STEPS_IN_PROCESS_ENV, run_python_module
from tests.support.paths import REPO_ROOT

GOLDEN = REPO_ROOT / "tests" / "data" / "golden" / "zstd"


@pytest.mark.parametrize("in_process", [False, True], ids=["process", "in-process"])
def test_a_step_runs_alike_as_a_process_and_in_process(
    in_process: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if in_process:
        monkeypatch.setenv(STEPS_IN_PROCESS_ENV, "1")
    else:
        monkeypatch.delenv(STEPS_IN_PROCESS_ENV, raising=False)
    done = run_python_module("pipelines.cli", ["info", str(GOLDEN)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"store      {GOLDEN}  (format v1") and "samples    5" in done.stdout

    failed = run_python_module("pipelines.cli", ["info", str(tmp_path / "nothing")])
    assert failed.returncode == 1 and "no committed store here" in failed.stderr

    log = tmp_path / "info.log"
    logged = run_python_module("pipelines.cli", ["info", str(GOLDEN)], log=log)
    assert logged.returncode == 0 and logged.stdout == ""
    assert log.read_text() == done.stdout


def main(argv: list[str]) -> int:
    """A step that prints the environment variable ``argv[0]`` (this module run as a step)."""
    import os

    print(os.environ.get(argv[0], "<unset>"))
    return 0


@pytest.mark.parametrize("in_process", [False, True], ids=["process", "in-process"])
def test_the_step_sees_its_environment_and_the_caller_keeps_its_own(
    in_process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    if in_process:
        monkeypatch.setenv(STEPS_IN_PROCESS_ENV, "1")
    monkeypatch.setenv("HSSTORE_TEST_MARK", "caller")
    step = run_python_module(__name__, ["HSSTORE_TEST_MARK"], env={**os.environ, "HSSTORE_TEST_MARK": "step"})
    assert (step.returncode, step.stdout) == (0, "step\n"), step.stderr
    assert os.environ["HSSTORE_TEST_MARK"] == "caller"
    assert run_python_module(__name__, ["HSSTORE_TEST_MARK"]).stdout == "caller\n"  # no env: the caller's


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
