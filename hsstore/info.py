"""``hsstore info``: what a store holds and what it costs per token, from the manifest alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hsstore.writer import FEATURES_DIR, SAMPLES_FILE

if TYPE_CHECKING:
    from hsstore.store import Store


def store_info(store: Store) -> dict[str, Any]:
    """A JSON-ready summary. Scripts rely on the top-level keys ``num_samples``, ``num_tokens``,
    ``bytes_per_token``, ``features`` and ``lineage``."""
    manifest = store.manifest
    num_tokens = manifest.num_tokens
    feature_bytes = {spec.name: 0 for spec in manifest.features}
    table_bytes = 0
    other_bytes = 0  # Zarr group metadata
    for shard in manifest.shards:
        prefix = f"{shard.path}/{FEATURES_DIR}/"
        for entry in shard.files:
            if entry.path == f"{shard.path}/{SAMPLES_FILE}":
                table_bytes += entry.size
            elif entry.path.startswith(prefix):
                array_name = entry.path[len(prefix) :].split("/", 1)[0]
                feature = array_name.split(".", 1)[0]
                if feature in feature_bytes:
                    feature_bytes[feature] += entry.size
                else:
                    other_bytes += entry.size
            else:
                other_bytes += entry.size

    def per_token(num_bytes: int) -> float:
        return round(num_bytes / num_tokens, 2) if num_tokens else 0.0

    features = {
        spec.name: {
            "shape": ["num_tokens", *spec.shape],
            "logical_dtype": spec.logical_dtype,
            "storage_dtype": spec.storage_dtype,
            "codec": spec.codec,
            "compression": spec.compression,
            "chunk_tokens": spec.chunk_tokens,
            "shard_tokens": spec.shard_tokens,
            "bytes": feature_bytes[spec.name],
            "bytes_per_token": per_token(feature_bytes[spec.name]),
            "raw_bytes_per_token": spec.raw_bytes_per_token,
        }
        for spec in manifest.features
    }
    total = manifest.num_bytes
    return {
        "url": store.url,
        "format_version": manifest.format_version,
        "generation": manifest.generation,
        "num_samples": manifest.num_samples,
        "num_tokens": num_tokens,
        "num_shards": len(manifest.shards),
        "num_files": sum(len(shard.files) for shard in manifest.shards) + 1,
        "bytes_on_disk": total,
        "bytes_per_token": per_token(total),
        "sample_table_bytes": table_bytes,
        "metadata_bytes": other_bytes,
        "features": features,
        "lineage": manifest.lineage.model_dump(mode="json"),
        "created_at": manifest.created_at,
        "updated_at": manifest.updated_at,
    }


def format_info(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`store_info`."""
    lines = [
        f"store      {info['url']}  (format v{info['format_version']}, generation {info['generation']})",
        f"samples    {info['num_samples']:,}",
        f"tokens     {info['num_tokens']:,}",
        f"shards     {info['num_shards']:,}  ({info['num_files']:,} files)",
        f"on disk    {_human(info['bytes_on_disk'])}  ({info['bytes_per_token']:,.1f} bytes/token)",
        "",
        f"{'feature':<22}{'shape':<26}{'codec':<10}{'compress':<10}{'bytes/token':>12}",
    ]
    for name, feature in info["features"].items():
        shape = "[" + ", ".join(str(d) for d in feature["shape"]) + "]"
        lines.append(
            f"{name:<22}{shape:<26}{feature['codec']:<10}{feature['compression']:<10}{feature['bytes_per_token']:>12,.1f}"
        )
    lineage = info["lineage"]
    target = lineage.get("target") or {}
    lines += [
        "",
        f"target     {target.get('architecture', '?')} from {target.get('name_or_path', '?')}",
        f"aux layers {lineage.get('aux_layer_ids')} ({lineage.get('layer_convention')}), final state {lineage.get('final_state_convention')}",
        f"max length {lineage.get('max_length')}, distribution {lineage.get('target_distribution')}",
    ]
    return "\n".join(lines)


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f}"
