"""Loading a plain safetensors checkpoint straight into a model built on the device.

Why not ``from_pretrained`` alone: it builds the model on the meta device and streams each tensor
through its conversion machinery (renamings, converters, dtype and tie plans) on four threads; on
an H200 host that loads the Qwen3-8B shape's 16 GB from the page cache in 9.6-14 s, the largest
part of an extraction's start (benchmarks/LOG.md, issue 31). A checkpoint whose tensor names are
the model's own needs none of that: the model is built on the device with its weights left
uninitialised (its buffers, such as the rotary tables, are computed as usual), and every tensor is
copied in from the files, several at a time (safetensors reads and the host-to-device copies
release the GIL).

Only plain checkpoints take this path; anything else returns None and the caller uses
``from_pretrained``: remote code, a quantisation config, ``*.bin`` files, a tensor name that is not
one of the model's (a renamed or converted layout), a model tensor that is neither in the files
nor tied to one that is, or a shape that differs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Tensors copied at once: enough to overlap the reads from the files with the copies to the device.
COPY_THREADS = 8


def load_direct(
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None = "sdpa",
) -> torch.nn.Module | None:
    """The checkpoint in ``model_dir`` as an eval-mode model on ``device`` in ``dtype``, or None
    when it is not a plain safetensors checkpoint of the model's own tensor names (module doc)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(model_dir)
    if not files or getattr(config, "quantization_config", None) is not None:
        return None
    where: dict[str, Path] = {}  # tensor name -> the file holding it
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is no mapping
                where[name] = path
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    model.tie_weights()
    tensors = model.state_dict(keep_vars=True)
    plan = _copy_plan(tensors, where, shapes, model_dir)
    if plan is None:
        return None

    def copy_one(name: str) -> None:
        with safe_open(str(where[name]), framework="pt") as handle:
            tensors[name].data.copy_(handle.get_tensor(name))

    with torch.no_grad(), ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="load") as pool:
        list(pool.map(copy_one, plan))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # What from_pretrained sets besides the weights: where it came from, its generation defaults.
    model.config._name_or_path = str(model_dir)
    with contextlib.suppress(OSError):  # no generation_config.json: from_config's defaults stay
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.eval()
    return model


def _copy_plan(
    tensors: dict[str, torch.Tensor], where: dict[str, Path], shapes: dict[str, tuple[int, ...]], model_dir: Path
) -> list[str] | None:
    """The names to copy, or None (logged) when the files and the model do not match one to one:
    a tensor the model lacks, one it has that no file holds and that is not tied to one a file
    holds (the tied lm_head), or a shape that differs."""
    unexpected = sorted(set(where) - set(tensors))
    if unexpected:
        logger.info("%s: tensors the model does not name (%s...): loading through from_pretrained", model_dir, unexpected[0])
        return None
    loaded_storage = {tensors[name].data_ptr() for name in where}
    untied = [name for name in tensors if name not in where and tensors[name].data_ptr() not in loaded_storage]
    if untied:
        logger.info("%s: the files lack %s: loading through from_pretrained", model_dir, untied[0])
        return None
    for name, shape in shapes.items():
        if shape != tuple(tensors[name].shape):
            logger.info("%s: %s is %s in the files, %s in the model: loading through from_pretrained",
                        model_dir, name, shape, tuple(tensors[name].shape))
            return None
    # Largest first: the pool's last tensors are small, so its threads finish together.
    return sorted(where, key=lambda name: -tensors[name].numel())


@contextlib.contextmanager
def _no_init_weights() -> Iterator[None]:
    """transformers' context that skips initialising weights (they are overwritten), by either
    of its homes (5.x: ``transformers.initialization``; 4.x: ``modeling_utils``)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield
