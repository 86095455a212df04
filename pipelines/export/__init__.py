"""Export trained drafts into the layouts vLLM and SGLang load (docs/serving-layouts.md).

The re-exports are lazy so that ``pipelines.export.cli`` (imported by every ``hsstore`` call to
build the parser) does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ExportError", "export_draft"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from pipelines.export import serving

        return getattr(serving, name)
    raise AttributeError(f"module 'pipelines.export' has no attribute {name!r}")
