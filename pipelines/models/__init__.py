"""Draft model definitions shared by training, export and evaluation (see docs/draft-model.md)."""

from pipelines.models.checkpoint import (
    DraftCheckpointError,
    init_from_pretrained,
    load_draft,
    resolve_draft_dir,
    save_draft,
)
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft, Eagle3Output

__all__ = [
    "DraftCheckpointError",
    "Eagle3Config",
    "Eagle3Draft",
    "Eagle3Output",
    "init_from_pretrained",
    "load_draft",
    "resolve_draft_dir",
    "save_draft",
]
