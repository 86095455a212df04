"""Stopping cleanly on SIGTERM/SIGINT (a batch scheduler's time limit, a preemption, Ctrl-C).

The first signal sets a flag that the job's loop checks at its next safe point (the trainer after
its step, generation before handing out another unit); a second signal stops at once. Handlers are
installed only on the main thread (Python delivers signals there) and restored on exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)


class StopRequest:
    """A context manager whose ``requested`` turns true on the first SIGTERM or SIGINT."""

    def __init__(self, then: str) -> None:
        self.then = then  # what the job does next, for the log line
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        logger.warning("signal %d: %s", signum, self.then)
        self.requested, self.signum = True, signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
