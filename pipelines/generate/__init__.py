"""``hsstore generate``: the target answers a dataset's prompts and writes a dataset that ``hsstore
extract`` reads as it is (docs/generate.md)."""

from __future__ import annotations

__all__ = ["run_generation"]


def run_generation(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - lazy: torch loads on call
    """See :func:`pipelines.generate.driver.run_generation`."""
    from pipelines.generate.driver import run_generation as run

    return run(*args, **kwargs)
