"""``hsstore import``: peers' per-sample feature dumps (SpecForge, speculators) into a store.

The re-exports are lazy so that ``pipelines.peer_import.cli`` (imported by every ``hsstore`` call to
build the parser) does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ImportSourceError", "import_features"]


def __getattr__(name: str) -> Any:
    if name == "import_features":
        from pipelines.peer_import.importer import import_features

        return import_features
    if name == "ImportSourceError":
        from pipelines.peer_import.sources import ImportSourceError

        return ImportSourceError
    raise AttributeError(f"module 'pipelines.peer_import' has no attribute {name!r}")
