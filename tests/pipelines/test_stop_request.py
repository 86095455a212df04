"""SIGTERM/SIGINT set the flag that generation and the trainer check; a second one stops at once,
unless it is the first delivered twice (GNU timeout)."""

from __future__ import annotations

import os
import signal

import pytest

from pipelines import stop_request
from pipelines.stop_request import StopRequest
from pipelines.train.preemption import Preemption


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_sets_the_flag_second_stops_and_handlers_come_back(
    sig: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(stop_request, "_clock", lambda: now[0])
    before = signal.getsignal(sig)
    with StopRequest("stopping") as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.signum == sig
        # GNU timeout signals the job, then its process group: the same request, twice at once.
        now[0] += 0.001
        os.kill(os.getpid(), sig)
        assert stop.requested
        now[0] += stop_request.REPEAT_AFTER_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) is before


def test_the_trainers_preemption_is_a_stop_request() -> None:
    from pipelines.train.distributed import Distributed

    with Preemption() as preemption:
        assert not preemption.agreed(Distributed())
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.agreed(Distributed())  # one process: its own flag
