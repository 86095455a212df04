"""Output shards: one file per unit, written under a temp name and renamed, then committed.

The driver calls :func:`commit_unit` as each unit comes back: the shard file and the unit's
rejections are written atomically, then the manifest is rewritten listing the shard. A crash
before the manifest rewrite leaves a shard file no manifest names; the rerun regenerates the unit
and overwrites it (same name), so nothing unlisted is ever read.
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

from hsstore.storage import StoreLocation
from pipelines.generate.manifest import GeneratedShard

SHARDS_DIR = "shards"
REJECTS_DIR = "rejects"


def shard_path(unit_index: int, output_format: str) -> str:
    return f"{SHARDS_DIR}/u{unit_index:06d}.{output_format}"


def rejects_path(unit_index: int) -> str:
    return f"{REJECTS_DIR}/u{unit_index:06d}.jsonl"


def encode_records(records: list[dict[str, Any]], output_format: str) -> bytes:
    """JSON lines, or one Parquet table whose nested columns hold the messages and metadata."""
    if output_format == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    # Chats and continuations may share a shard: every row gets every key (absent ones null,
    # which extraction's reader drops). from_pylist takes its columns from the first row only.
    keys = list(dict.fromkeys(key for record in records for key in record))
    rows = [{key: record.get(key) for key in keys} for record in records]
    pq.write_table(pa.Table.from_pylist(rows), buffer, compression="zstd")
    return buffer.getvalue()


def write_unit(
    location: StoreLocation,
    unit_index: int,
    output_format: str,
    records: list[dict[str, Any]],
    rejections: list[dict[str, Any]],
    counts: dict[str, int],
) -> GeneratedShard:
    """Write one unit's shard and rejections (atomically); returns its manifest entry."""
    data = encode_records(records, output_format)
    path = shard_path(unit_index, output_format)
    location.makedirs(SHARDS_DIR)
    location.write_bytes_atomic(path, data)
    rejected: dict[str, int] = {}
    for rejection in rejections:
        rejected[rejection["reason"]] = rejected.get(rejection["reason"], 0) + 1
    if rejections:
        location.makedirs(REJECTS_DIR)
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejections)
        location.write_bytes_atomic(rejects_path(unit_index), lines.encode("utf-8"))
    elif location.exists(rejects_path(unit_index)):
        location.delete(rejects_path(unit_index))  # an earlier attempt's
    return GeneratedShard(
        unit_index=unit_index,
        path=path,
        num_records=len(records) + len(rejections),
        num_written=len(records),
        rejected=dict(sorted(rejected.items())),
        num_answers=counts.get("num_answers", 0),
        num_new_tokens=counts.get("num_new_tokens", 0),
        num_truncated=counts.get("num_truncated", 0),
        num_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
