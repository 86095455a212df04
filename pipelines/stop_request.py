"""Stopping cleanly on SIGTERM/SIGINT (a batch scheduler's time limit, a preemption, Ctrl-C).

The first signal sets a flag that the job's loop checks at its next safe point (the trainer after
its step, generation before handing out another unit); a second signal stops at once. Handlers are
installed only on the main thread (Python delivers signals there) and restored on exit.

GNU ``timeout`` sends its signal twice, to the job and then to the job's process group (``kill(pid)``
then ``kill(0)``), so a job bounded by ``timeout 3600 hsstore generate ...`` receives two SIGTERMs a
few microseconds apart. Taking the second for a second request turned the clean stop into an abort
that lost the units in flight; a repeat within :data:`REPEAT_AFTER_S` of the first is therefore the
same request.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# A second signal sooner than this after the first is the first delivered again (``timeout``); a
# person pressing Ctrl-C twice to stop at once is slower.
REPEAT_AFTER_S = 1.0
_clock = time.monotonic  # the tests move it


class StopRequest:
    """A context manager whose ``requested`` turns true on the first SIGTERM or SIGINT."""

    def __init__(self, then: str) -> None:
        self.then = then  # what the job does next, for the log line
        self.requested = False
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        now = _clock()
        if self.requested:
            if now - self._first_at < REPEAT_AFTER_S:
                return  # the first signal delivered twice
            raise KeyboardInterrupt  # a second signal: stop now
        logger.warning("signal %d: %s", signum, self.then)
        self.requested, self.signum, self._first_at = True, signum, now

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
