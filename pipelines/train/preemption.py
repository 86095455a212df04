"""Stopping cleanly on SIGTERM/SIGINT: the loop checkpoints at the end of the step and returns."""

from __future__ import annotations

import torch

from pipelines.stop_request import StopRequest
from pipelines.train.distributed import Distributed, all_reduce_


class Preemption(StopRequest):
    """SIGTERM/SIGINT set a flag (a second one stops at once); :meth:`agreed` asks every rank."""

    def __init__(self) -> None:
        super().__init__("checkpointing after this step, then stopping")

    def agreed(self, dist_state: Distributed) -> bool:
        """Whether any rank was signalled (an all-reduce: called at log steps only on several ranks)."""
        if dist_state.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=dist_state.device)
        return bool(all_reduce_(flag, dist_state).item())
