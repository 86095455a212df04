"""Run SpecForge's own CLI after the shims ``benchmarks/specforge/peer.py`` asked for.

``python benchmarks/specforge/shims.py --shims JSON <specforge CLI arguments>``: the subprocess
``train_specforge`` starts when SpecForge cannot run unpatched (the CPU, or hsstore's optimizer
knobs). Each shim is stated in ``benchmarks.specforge.peer``'s docstring; nothing else of SpecForge changes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def _install_cpu_loss() -> None:
    """Replace ``specforge.core.loss`` (Triton) with an eager function of the same value and gradient."""
    import types

    import specforge.core
    import torch

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits: torch.Tensor, target: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
            batch, length, _ = logits.shape
            log_q = torch.log_softmax(logits.float(), dim=-1)
            per_position = -(target.float() * log_q).sum(-1) * position_mask.reshape(batch, length).float()
            return per_position.mean()  # over all B*T positions, masked ones included, as the kernel

    module = types.ModuleType("specforge.core.loss")
    module.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = module
    specforge.core.loss = module


def _install_optimizer(betas: Sequence[float], weight_decay: float, min_lr_ratio: float) -> None:
    """Give SpecForge's ``BF16Optimizer`` hsstore's AdamW betas, weight decay and final LR."""
    import specforge.optimizer as opt
    from torch.optim.lr_scheduler import CosineAnnealingLR

    original = opt.BF16Optimizer.__init__

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for group in self.optimizer.param_groups:
            group["betas"], group["weight_decay"] = tuple(betas), weight_decay
        after = getattr(self.scheduler, "after_scheduler", None)
        if isinstance(after, CosineAnnealingLR):
            after.eta_min = min_lr_ratio * self.optimizer.param_groups[0]["initial_lr"]

    opt.BF16Optimizer.__init__ = patched


def _main(argv: list[str]) -> int:
    """``shims.py --shims JSON train -c CONFIG``: apply the shims, run SpecForge's CLI."""
    if argv[:1] != ["--shims"]:
        raise SystemExit("usage: shims.py --shims JSON <specforge CLI arguments>")
    shims = json.loads(argv[1])
    if shims.get("cpu-loss"):
        _install_cpu_loss()
    if "optimizer" in shims:
        _install_optimizer(**shims["optimizer"])
    from specforge.cli import main

    return main(argv[2:])


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
