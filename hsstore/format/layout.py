"""Where things are in a store, and the schema of the sample table (docs/format.md).

::

    STORE/
      manifest.json                         # the commit point (hsstore.manifest)
      manifest.lock                         # the committers' lock file (local stores)
      shards/<shard_id>.<attempt>/          # one store shard: written by one writer, then immutable
        samples.arrow                       # Arrow IPC, one row per sample (SAMPLE_SCHEMA)
        features.zarr/<array>/zarr.json     # Zarr v3 metadata of one array
        features.zarr/<array>/c/<n>/0[/0..] # Zarr shard file n of the array (zarr_shard_key)

Vocabulary: a *store shard* is a folder under ``shards/`` (the unit of writing and committing); a
*Zarr shard file* is one file of one array holding whole inner chunks plus their index; an *inner
chunk* is the unit of reading and of the crc32c. ``<array>`` is a feature's name, or
``<feature>.scale`` for a codec's extra array (:data:`SCALE_SUFFIX`).
"""

from __future__ import annotations

import pyarrow as pa

MANIFEST_NAME = "manifest.json"
LOCK_NAME = "manifest.lock"
SHARDS_DIR = "shards"
SAMPLES_FILE = "samples.arrow"
FEATURES_DIR = "features.zarr"
ZARR_METADATA_FILE = "zarr.json"

# Extra arrays of a feature are named <feature><suffix>; fp8's per-row scales use this one.
SCALE_SUFFIX = ".scale"
# fp8 scale arrays group this many value chunks (and Zarr shard files) into one: chunked like the
# values they would be KB-sized, doubling the chunks a read touches.
SCALE_GROUPING = 16

# Served from the Arrow sample table, not from Zarr.
TABLE_FEATURES = ("input_ids", "loss_mask")

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("source_id", pa.string(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("token_offset", pa.int64(), nullable=False),
        pa.field("num_loss_tokens", pa.int32(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    ]
)


def shard_folder(shard_id: str, attempt: str) -> str:
    """The folder of one writing attempt at a store shard (attempts never share files)."""
    return f"{SHARDS_DIR}/{shard_id}.{attempt}"


def samples_path(folder: str) -> str:
    return f"{folder}/{SAMPLES_FILE}"


def features_root(folder: str) -> str:
    """The Zarr group of a store shard's feature arrays."""
    return f"{folder}/{FEATURES_DIR}"


def array_dir(folder: str, array_name: str) -> str:
    return f"{folder}/{FEATURES_DIR}/{array_name}"


def array_of_path(folder: str, path: str) -> str | None:
    """The array name a file of store shard ``folder`` belongs to, or None for other files."""
    prefix = f"{folder}/{FEATURES_DIR}/"
    if not path.startswith(prefix):
        return None
    name = path[len(prefix) :].split("/", 1)[0]
    return name if name != ZARR_METADATA_FILE else None


def feature_of_array(array_name: str) -> str:
    """The feature an array holds (``aux_hidden_states.scale`` -> ``aux_hidden_states``)."""
    return array_name.split(".", 1)[0]


def zarr_shard_key(zarr_shard: int, row_ndim: int) -> str:
    """The key of Zarr shard file ``zarr_shard`` inside its array's folder, for arrays chunked along
    the token axis only: Zarr v3's default chunk key encoding with "/" (``c/<n>/0/0...``)."""
    return "/".join(["c", str(zarr_shard), *(["0"] * row_ndim)])
