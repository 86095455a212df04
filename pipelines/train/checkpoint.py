"""Trainer checkpoints: the draft, the optimizer and the few scalars that make resume exact.

Layout (``output_dir/checkpoints/``)::

    step_000120/
      draft/                 # pipelines.models.save_draft: config.json + model.safetensors (fp32)
      optimizer.pt           # AdamW state_dict: tensors and numbers only, read with weights_only=True
      trainer_state.json     # step, loader state (hsstore.loader.LoaderState), metrics so far, recipe
    final/                   # the same, written when training ends; a CHECKPOINT for export/evaluate

A checkpoint is written into ``.<name>.tmp`` and renamed into place, so a directory with a
``trainer_state.json`` under its final name is always complete; resume picks the newest one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from hsstore.errors import HsstoreError

STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
DRAFT_DIR = "draft"
FINAL_NAME = "final"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(HsstoreError, ValueError):
    """A trainer checkpoint is incomplete or does not belong to this run."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(
    root: Path,
    name: str,
    draft: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> Path:
    """Write one checkpoint atomically (temp directory, then rename); returns its path."""
    from pipelines.models.checkpoint import save_draft

    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    work = root / f".{name}.tmp"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    save_draft(draft, work / DRAFT_DIR)  # type: ignore[arg-type]
    torch.save(optimizer.state_dict(), work / OPTIMIZER_NAME)
    (work / STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    if final.exists():
        # Replacing (final/ of a rerun, or a step rewritten after resume): move the old one aside first.
        old = root / f".{name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(work, final)
        shutil.rmtree(old)
    else:
        os.replace(work, final)
    return final


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first (``final`` included)."""
    found = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        if not (child / STATE_NAME).is_file():
            continue
        if _STEP_RE.match(child.name) or child.name == FINAL_NAME:
            found.append((read_state(child)["step"], child))
    # final after step_N of the same step: it is the one to resume from (and the same weights).
    return sorted(found, key=lambda item: (item[0], item[1].name == FINAL_NAME))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / STATE_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read the trainer state: {err}") from err


def load_optimizer(optimizer: torch.optim.Optimizer, checkpoint: Path, device: torch.device) -> None:
    """Restore AdamW state; ``weights_only=True`` refuses anything but tensors and plain values."""
    path = checkpoint / OPTIMIZER_NAME
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"{path}: cannot load the optimizer state: {err}") from err
    optimizer.load_state_dict(state)


def prune_checkpoints(root: Path, keep: int | None) -> None:
    """Keep the newest ``keep`` step_* checkpoints (``final`` is never removed)."""
    if keep is None:
        return
    steps = [(step, path) for step, path in list_checkpoints(root) if path.name != FINAL_NAME]
    for _, path in steps[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
