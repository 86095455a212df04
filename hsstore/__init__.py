"""hsstore: a feature store for training speculative-decoding drafts.

A target LLM runs once; its per-token features (auxiliary hidden states, the final state or output
distribution, token ids, loss masks) land in chunked Zarr/Arrow shards committed by a manifest that
pins their lineage. Drafts are then trained, swept and evaluated from the store, many times, without
loading the target again.

Importing this package never imports torch, ray or transformers.
"""

from hsstore import aux_layers
from hsstore.commit import commit_shards, committed_shard_ids, ensure_store
from hsstore.errors import (
    AuxLayerError,
    CodecError,
    CommitConflictError,
    HsstoreError,
    LineageMismatchError,
    ManifestError,
    MissingDependencyError,
    RecipeError,
    ShardCorruptError,
    StoreNotFoundError,
    StoreWriteError,
)
from hsstore.format.features import FeatureSpec
from hsstore.lineage import Lineage, TargetIdentity
from hsstore.loader import LoaderState, StreamingLoader
from hsstore.manifest import FORMAT_VERSION, FileEntry, ShardRecord, StoreManifest, parse_manifest
from hsstore.storage import StoreLocation
from hsstore.store import Store, open_store
from hsstore.store_writer import StoreWriter
from hsstore.verify import Problem, verify_store
from hsstore.writer import ShardWriter

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "AuxLayerError",
    "CodecError",
    "CommitConflictError",
    "FeatureSpec",
    "FileEntry",
    "HsstoreError",
    "Lineage",
    "LoaderState",
    "LineageMismatchError",
    "ManifestError",
    "MissingDependencyError",
    "Problem",
    "RecipeError",
    "ShardCorruptError",
    "ShardRecord",
    "ShardWriter",
    "Store",
    "StoreLocation",
    "StoreManifest",
    "StoreNotFoundError",
    "StoreWriteError",
    "StoreWriter",
    "StreamingLoader",
    "TargetIdentity",
    "aux_layers",
    "commit_shards",
    "committed_shard_ids",
    "ensure_store",
    "open_store",
    "parse_manifest",
    "verify_store",
]
