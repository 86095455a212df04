"""torchrun's environment -> process group, device, and the DDP wrapper the trainer uses.

``torchrun --nproc_per_node N -m pipelines.cli train RECIPE`` (NCCL on GPUs, gloo on CPUs). The
objective (``pipelines.train.objective``) is an ``nn.Module`` wrapped in
``DistributedDataParallel``: bucketed gradient all-reduce overlapped with the backward pass, and
``no_sync`` for all but the last micro-batch of an accumulated step.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # we initialised the process group, so we tear it down
    device: torch.device = torch.device("cpu")  # where collectives run (NCCL needs CUDA tensors)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_pref: str) -> tuple[Distributed, torch.device]:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) -> process group and device."""
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_pref.startswith("cuda") or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        index = int(device_pref.split(":")[1]) if ":" in device_pref else local_rank
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        owns = True
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return Distributed(rank, world_size, local_rank, owns, device), device


def all_reduce_(tensor: torch.Tensor, dist_state: Distributed) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (a no-op on one process)."""
    if dist_state.world_size > 1:
        import torch.distributed as dist

        if tensor.device != dist_state.device:
            on_device = tensor.to(dist_state.device)
            dist.all_reduce(on_device)
            tensor.copy_(on_device)
        else:
            dist.all_reduce(tensor)
    return tensor


def wrap_ddp(module: nn.Module, dist_state: Distributed) -> nn.Module:
    """``DistributedDataParallel(module)`` on several ranks, the module itself on one.

    ``broadcast_buffers=False``: the draft's buffers (the vocabulary maps) are equal on every rank
    and never change while training, so broadcasting them before each forward is wasted work."""
    if dist_state.world_size == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [dist_state.device.index] if dist_state.device.type == "cuda" else None
    return DistributedDataParallel(
        module, device_ids=device_ids, broadcast_buffers=False, gradient_as_bucket_view=True
    )


def no_sync_unless(last: bool, module: nn.Module) -> AbstractContextManager[object]:
    """DDP's ``no_sync`` for the micro-batches before the last of an accumulated step."""
    if last or not hasattr(module, "no_sync"):
        return nullcontext()
    return module.no_sync()  # type: ignore[no-any-return]
