"""Stopping cleanly on SIGTERM/SIGINT: the loop checkpoints at the end of the step and returns."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch

from pipelines.train.distributed import Distributed, all_reduce_

logger = logging.getLogger(__name__)


class Preemption:
    """SIGTERM/SIGINT set a flag (a second one stops at once); :meth:`agreed` asks every rank."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        logger.warning("signal %d: checkpointing after this step, then stopping", signum)
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self, dist_state: Distributed) -> bool:
        """Whether any rank was signalled (an all-reduce: called at log steps only on several ranks)."""
        if dist_state.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=dist_state.device)
        return bool(all_reduce_(flag, dist_state).item())
