"""SIGTERM/SIGINT set the flag that generation and the trainer check; a second one stops at once."""

from __future__ import annotations

import os
import signal

import pytest

from pipelines.stop_request import StopRequest
from pipelines.train.preemption import Preemption


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_sets_the_flag_second_stops_and_handlers_come_back(sig: int) -> None:
    before = signal.getsignal(sig)
    with StopRequest("stopping") as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.signum == sig
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) is before


def test_the_trainers_preemption_is_a_stop_request() -> None:
    from pipelines.train.distributed import Distributed

    with Preemption() as preemption:
        assert not preemption.agreed(Distributed())
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.agreed(Distributed())  # one process: its own flag
