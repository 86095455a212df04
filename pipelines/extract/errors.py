"""Errors of the extraction job; each also inherits the builtin a caller would catch."""

from __future__ import annotations

from hsstore.errors import HsstoreError


class ExtractionError(HsstoreError, RuntimeError):
    """A work unit failed for good (its actor died too often, or the worker raised)."""


class TargetNotFoundError(HsstoreError, FileNotFoundError):
    """The target is neither a model directory nor a hub id that could be fetched."""


class RecordSourceError(HsstoreError, FileNotFoundError):
    """An input data file cannot be opened or is of an unknown format."""
