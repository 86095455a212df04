"""Training drafts from the store: EAGLE-3/EAGLE-4 TTT objective, candidate heads, the loop.

``run_training(recipe)`` is the entry point (``hsstore train`` calls it); the recipe model is
:class:`TrainRecipe`. Importing this package stays light: the loop imports torch when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipelines.train.config import TrainRecipe
from pipelines.train.teacher_mode import TeacherMode

if TYPE_CHECKING:
    from pipelines.train.trainer import run_training as run_training


def __getattr__(name: str) -> Any:
    if name == "run_training":
        from pipelines.train.trainer import run_training

        return run_training
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TeacherMode", "TrainRecipe", "run_training"]
