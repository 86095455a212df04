"""Which executor runs an extraction: ``executor: auto`` resolved against the recipe and this machine.

Planning imports this (the driver resolves the executor before it plans), so it imports neither
torch nor Ray: the GPUs are counted from the environment and the driver's device list.
"""

from __future__ import annotations

import itertools
import os

from pipelines.extract.recipe import RaySection


def visible_gpu_count() -> int:
    """NVIDIA GPUs this process may use, without importing torch (the driver of a Ray run never
    does): ``CUDA_VISIBLE_DEVICES`` when set, else the driver's ``/proc/driver/nvidia/gpus``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        # CUDA stops at the first invalid id ("-1" hides every GPU).
        return len(list(itertools.takewhile(lambda part: not part.startswith("-"), ids)))
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def resolve_executor(executor: str, settings: RaySection, gpus: int | None = None) -> str:
    """``executor: auto``: in process when the job has exactly one worker on this machine (no
    cluster address, at most one GPU, ``ray.num_workers`` unset or 1), else Ray actors.

    Why: a lone worker gains nothing from Ray but pays for it before its first forward (``ray.init``,
    an actor process importing torch and transformers: ~15 s on an H200 host, benchmarks/LOG.md), as
    vLLM runs one GPU in process and uses Ray for several. What the in-process run gives up is the
    actor's restart: a worker that dies takes the job with it, and a rerun resumes from the
    committed units (docs/extraction.md)."""
    if executor != "auto":
        return executor
    gpus = visible_gpu_count() if gpus is None else gpus
    one_worker = settings.address is None and (settings.num_workers or 1) == 1 and gpus <= 1
    return "local" if one_worker else "ray"
