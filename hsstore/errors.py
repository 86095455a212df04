"""Error types. Each also inherits the builtin a caller would naturally catch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class HsstoreError(Exception):
    """Base class of every error hsstore raises on purpose."""


class StoreNotFoundError(HsstoreError, FileNotFoundError):
    """The URL holds no committed store (no manifest.json)."""


class ManifestError(HsstoreError, ValueError):
    """A manifest is malformed, of an unknown format version, or disagrees with the files."""


class CodecError(HsstoreError, ValueError):
    """A feature cannot be encoded or decoded with the codec asked for."""


class StoreWriteError(HsstoreError, OSError):
    """Writing a shard or committing the manifest failed; the store is left as last committed."""


class ShardCorruptError(HsstoreError, OSError):
    """A shard named by the manifest is missing, truncated or fails its checksum."""


class CommitConflictError(HsstoreError, RuntimeError):
    """Another writer committed (or holds the store) between our read and our commit."""


class LineageMismatchError(HsstoreError, ValueError):
    """What a job expects (target, tokenizer, layers, codecs...) differs from the store's lineage."""


class RecipeError(HsstoreError, ValueError):
    """A recipe is invalid; the message names the dotted key."""


class AuxLayerError(HsstoreError, ValueError):
    """Aux layer ids outside what the target has (hsstore.aux_layers holds the accepted range)."""


class MissingDependencyError(HsstoreError, ImportError):
    """An optional module is not installed; the message names the extra that adds it
    (:mod:`hsstore.extras`)."""


def botocore_responses(err: BaseException) -> Iterator[dict[str, Any]]:
    """The botocore response dicts along ``err``'s chain of causes, outermost first: s3fs turns a
    botocore ``ClientError`` into an ``OSError`` and keeps it as ``__cause__``, with the status,
    error code and headers the caller may need. Each exception is visited once (a chain can loop)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            yield response
        current = current.__cause__ or current.__context__
