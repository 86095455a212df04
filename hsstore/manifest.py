"""The manifest: the commit point of a store.

``manifest.json`` is written last and atomically. It names every committed shard with its files,
sizes and checksums, the features and their codecs, and the lineage. Files it does not name are
garbage from a crashed writer and are never read.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zlib
from datetime import UTC, datetime
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hsstore.errors import ManifestError
from hsstore.format.features import FeatureSpec
from hsstore.format.layout import MANIFEST_NAME
from hsstore.lineage import Lineage

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
SHARD_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_SHARD_ID_RE = re.compile(SHARD_ID_PATTERN)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def check_relative_path(path: str) -> str:
    """Refuse paths that leave the store: absolute, URLs, ``..``, backslashes, empty parts."""
    if not path or path.startswith(("/", "\\")) or "://" in path or ":" in path.split("/")[0]:
        raise ValueError(f"path {path!r} must be relative to the store root")
    if "\\" in path:
        raise ValueError(f"path {path!r} must use '/' separators")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"path {path!r} must not contain empty, '.' or '..' parts")
    return path


def check_shard_id(shard_id: str) -> str:
    if not _SHARD_ID_RE.match(shard_id):
        raise ValueError(
            f"shard id {shard_id!r} must match {SHARD_ID_PATTERN} (letters, digits, '_', '.', '-')"
        )
    return shard_id


class FileEntry(BaseModel):
    """One file of a shard, relative to the store root."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _relative(cls, path: str) -> str:
        return check_relative_path(path)


class ShardRecord(BaseModel):
    """A written shard, as its writer describes it to the committer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: str
    path: str = Field(description="the shard's folder, relative to the store root")
    num_samples: int = Field(ge=0)
    num_tokens: int = Field(ge=0)
    num_bytes: int = Field(ge=0)
    checksum: str = Field(description="sha256 over the sorted (path, size, sha256) of its files")
    files: list[FileEntry]
    created_at: str = Field(default_factory=now_iso)
    sample_tokens: str | None = Field(
        default=None,
        description=(
            "every sample's token count in table order (int32 little-endian, zlib, base64; "
            "encode_sample_tokens): a loader plans an epoch from the manifest alone instead of "
            "reading every shard's sample table first. None in stores written before it existed"
        ),
    )

    @field_validator("shard_id")
    @classmethod
    def _shard_id(cls, shard_id: str) -> str:
        return check_shard_id(shard_id)

    @field_validator("path")
    @classmethod
    def _relative(cls, path: str) -> str:
        return check_relative_path(path)

    @model_validator(mode="after")
    def _consistent(self) -> ShardRecord:
        for entry in self.files:
            if not entry.path.startswith(self.path + "/"):
                raise ValueError(f"file {entry.path!r} lies outside its shard folder {self.path!r}")
        if sum(entry.size for entry in self.files) != self.num_bytes:
            raise ValueError(f"num_bytes {self.num_bytes} != sum of its file sizes")
        if shard_checksum(self.files) != self.checksum:
            raise ValueError("checksum does not match the file list")
        if self.sample_tokens is not None:
            lengths = decode_sample_tokens(self.sample_tokens)
            if len(lengths) != self.num_samples or int(lengths.sum()) != self.num_tokens:
                raise ValueError(
                    f"sample_tokens holds {len(lengths)} samples of {int(lengths.sum())} tokens, "
                    f"the record says {self.num_samples} samples of {self.num_tokens}"
                )
        return self


def encode_sample_tokens(lengths: Any) -> str:
    """Per-sample token counts as ShardRecord.sample_tokens: int32 LE, zlib, base64 (~1-2 bytes
    per sample in the manifest: lengths compress well)."""
    raw = np.asarray(lengths, dtype="<i4").tobytes()
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def decode_sample_tokens(text: str) -> np.ndarray:
    """The inverse of :func:`encode_sample_tokens` (int64 array)."""
    try:
        raw = zlib.decompress(base64.b64decode(text, validate=True))
    except (ValueError, zlib.error) as err:
        raise ValueError(f"sample_tokens is not base64 zlib int32 data ({err})") from err
    if len(raw) % 4:
        raise ValueError(f"sample_tokens decodes to {len(raw)} bytes, not a multiple of 4")
    lengths = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    if np.any(lengths < 0):
        raise ValueError("sample_tokens holds a negative length")
    return lengths


def shard_checksum(files: list[FileEntry]) -> str:
    digest = hashlib.sha256()
    for entry in sorted(files, key=lambda e: e.path):
        digest.update(f"{entry.path}\0{entry.size}\0{entry.sha256}\n".encode())
    return digest.hexdigest()


class StoreManifest(BaseModel):
    """The whole committed state of a store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    generation: int = Field(default=0, ge=0, description="incremented by every commit")
    created_at: str = Field(default_factory=now_iso)
    updated_at: str = Field(default_factory=now_iso)
    features: list[FeatureSpec]
    lineage: Lineage
    shards: list[ShardRecord] = Field(default_factory=list)
    num_samples: int = Field(default=0, ge=0)
    num_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> StoreManifest:
        names = [spec.name for spec in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"features: duplicate feature names {names}")
        ids = [shard.shard_id for shard in self.shards]
        if len(set(ids)) != len(ids):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"shards: duplicate shard ids {dupes}")
        paths = [shard.path for shard in self.shards]
        if len(set(paths)) != len(paths):
            raise ValueError("shards: two shards share a folder")
        if sum(s.num_samples for s in self.shards) != self.num_samples:
            raise ValueError(
                f"num_samples {self.num_samples} != sum over shards "
                f"{sum(s.num_samples for s in self.shards)}"
            )
        if sum(s.num_tokens for s in self.shards) != self.num_tokens:
            raise ValueError(
                f"num_tokens {self.num_tokens} != sum over shards {sum(s.num_tokens for s in self.shards)}"
            )
        return self

    @property
    def feature_map(self) -> dict[str, FeatureSpec]:
        return {spec.name: spec for spec in self.features}

    @property
    def num_bytes(self) -> int:
        return sum(shard.num_bytes for shard in self.shards)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=False) + "\n"


def parse_manifest(data: bytes | str, source: str = MANIFEST_NAME) -> StoreManifest:
    """Parse and validate manifest JSON; every error names ``source`` and the offending field."""
    return parse_versioned_json(data, source, StoreManifest, SUPPORTED_FORMAT_VERSIONS, "manifest", "store")


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_versioned_json(
    data: bytes | str, source: str, model: type[ModelT], supported: tuple[int, ...], what: str, holder: str
) -> ModelT:
    """JSON with a ``format_version`` validated into ``model`` (a store's manifest, a generated
    dataset's): unknown versions refused, every error a ManifestError naming ``source`` and the
    offending field. ``what`` names the document, ``holder`` what it describes, in the messages."""
    try:
        raw: Any = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{source}: not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: expected a JSON object, found {type(raw).__name__}")
    version = raw.get("format_version")
    if version not in supported:
        raise ManifestError(
            f"{source}: format_version {version!r} is not supported by this hsstore "
            f"(supported: {list(supported)}); upgrade hsstore to read this {holder}"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in err.errors()
        )
        raise ManifestError(f"{source}: invalid {what}: {problems}") from err
