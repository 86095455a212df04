"""The generated dataset's manifest: ``<output>/generation.json``, the commit point of every shard.

A shard (``shards/u000042.jsonl`` or ``.parquet``) is written under a temp name and renamed, its
rejections saved beside it (``rejects/u000042.jsonl``), and only then listed here by an atomic
rewrite of this file. So the manifest names exactly the committed shards: a reader (``hsstore
extract``) reads those and nothing else, and a rerun skips them. ``complete`` turns true when
every unit of the input is committed; extraction refuses an incomplete dataset.

The lineage says who wrote the answers (target identity, tokenizer and chat template hashes,
sampling settings, backend) from which source (its fingerprint); a rerun into the same folder must
have the same lineage (else refused), and extraction copies it into its store's lineage.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hsstore.errors import HsstoreError
from hsstore.manifest import now_iso, parse_versioned_json
from hsstore.storage import StoreLocation

MANIFEST_NAME = "generation.json"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)


class GenerationError(HsstoreError, RuntimeError):
    """A generation run cannot go on (lineage mismatch, a backend failing for good)."""


class GeneratedShard(BaseModel):
    """One committed unit: its file and what it holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit_index: int = Field(ge=0)
    path: str = Field(description="relative to the dataset folder")
    num_records: int = Field(ge=0, description="records read into the unit (written + rejected)")
    num_written: int = Field(ge=0)
    rejected: dict[str, int] = Field(default_factory=dict, description="reason -> records")
    num_answers: int = Field(0, ge=0)
    num_new_tokens: int = Field(0, ge=0)
    num_truncated: int = Field(0, ge=0, description="records with an answer cut short")
    num_bytes: int = Field(ge=0)
    sha256: str


class GenerationLineage(BaseModel):
    """Who wrote the answers, how, from what. Copied into the lineage of stores extracted from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: dict[str, Any] = Field(description="pipelines.target_identity.target_identity()")
    dtype: str | None = Field(None, description="compute dtype (transformers backend)")
    backend: Literal["transformers", "openai"]
    served_model: str | None = Field(None, description="the model name sent to the server (openai)")
    tokenizer_sha256: str
    chat_template_sha256: str | None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any]
    text_prefix_tokens: int
    max_context: int
    source_fingerprint: str = Field(description="sha256 of the input files' bytes and the limit")
    code_version: str
    source_generations: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the lineage of each input folder that hsstore generate wrote (answers written again)",
    )


class GenerationManifest(BaseModel):
    """The committed state of a generated dataset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    kind: Literal["hsstore-generated-dataset"] = "hsstore-generated-dataset"
    created_at: str = Field(default_factory=now_iso)
    updated_at: str = Field(default_factory=now_iso)
    lineage: GenerationLineage
    output_format: Literal["jsonl", "parquet"]
    units_max_records: int = Field(ge=1, description="records per unit: how the input was cut")
    shards: list[GeneratedShard] = Field(default_factory=list)
    complete: bool = Field(False, description="every unit of the input is committed")
    num_units: int | None = Field(None, description="units of the input (known once complete)")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1) + "\n"


def read_manifest(location: StoreLocation) -> GenerationManifest | None:
    """The folder's manifest, or None when there is none yet."""
    if not location.exists(MANIFEST_NAME):
        return None
    return parse_versioned_json(
        location.read_bytes(MANIFEST_NAME), location.path(MANIFEST_NAME), GenerationManifest,
        SUPPORTED_FORMAT_VERSIONS, "generation manifest", "dataset",
    )


def write_manifest(location: StoreLocation, manifest: GenerationManifest) -> None:
    """Atomically replace the manifest (the commit point)."""
    location.write_bytes_atomic(MANIFEST_NAME, manifest.to_json().encode("utf-8"))


def is_generated_dataset(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is a folder written by ``hsstore generate`` (it holds the manifest)."""
    lowered = url.lower().rstrip("/")
    if lowered.endswith((".jsonl", ".json", ".ndjson", ".parquet", ".gz", ".zst", ".bz2", ".xz")):
        return False
    try:
        return StoreLocation(url, storage_options).exists(MANIFEST_NAME)
    except (OSError, ValueError):
        return False


def expand_generated_data(
    urls: list[str], allow_unfinished: bool = False, storage_options: dict[str, Any] | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """Data URLs with each generated dataset folder replaced by its committed shard files, in unit
    order, and the lineage of each such folder (for the extracted store's lineage: whether the
    generation finished, and which units it holds).

    Raises :class:`GenerationError` for a dataset whose generation has not finished, unless
    ``allow_unfinished`` (a run cut by its time limit: its committed units are whole and verified
    answers, only fewer of them).
    """
    files: list[str] = []
    lineages: list[dict[str, Any]] = []
    for url in urls:
        if not is_generated_dataset(url, storage_options):
            files.append(url)
            continue
        location = StoreLocation(url, storage_options)
        manifest = read_manifest(location)
        assert manifest is not None  # is_generated_dataset saw the file
        if not manifest.complete and not allow_unfinished:
            raise GenerationError(
                f"{location.path(MANIFEST_NAME)}: the generation is not finished "
                f"({len(manifest.shards)} units committed); rerun hsstore generate with its recipe, "
                "or set allow_unfinished_generation: true to read the committed units alone"
            )
        shards = sorted(manifest.shards, key=lambda s: s.unit_index)
        base = url.rstrip("/")
        files.extend(posixpath.join(base, shard.path) for shard in shards)
        lineages.append(
            {
                "dataset": url,
                **manifest.lineage.model_dump(mode="json"),
                "complete": manifest.complete,
                "units": [shard.unit_index for shard in shards],
            }
        )
    return files, lineages
