"""``hsstore info``: what a store holds and what it costs per token, from the manifest alone."""

from __future__ import annotations

from typing import Any

from hsstore.format.layout import array_of_path, feature_of_array, samples_path
from hsstore.manifest import StoreManifest


def store_info(manifest: StoreManifest, url: str) -> dict[str, Any]:
    """A JSON-ready summary of the store at ``url``. Scripts rely on the top-level keys
    ``num_samples``, ``num_tokens``, ``bytes_per_token``, ``features`` and ``lineage``."""
    num_tokens = manifest.num_tokens
    feature_bytes = {spec.name: 0 for spec in manifest.features}
    table_bytes = 0
    other_bytes = 0  # Zarr group metadata
    for shard in manifest.shards:
        for entry in shard.files:
            array_name = array_of_path(shard.path, entry.path)
            feature = None if array_name is None else feature_of_array(array_name)
            if entry.path == samples_path(shard.path):
                table_bytes += entry.size
            elif feature in feature_bytes:
                feature_bytes[feature] += entry.size
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
        "url": url,
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
    for generated in lineage.get("generation") or []:  # data written by ``hsstore generate``
        writer = generated.get("target") or {}
        same = writer.get("config_sha256") == target.get("config_sha256") and writer.get(
            "weight_files"
        ) == target.get("weights_sha256")
        sampling = generated.get("sampling") or {}
        lines.append(
            f"answers    by {'this target' if same else 'another model'} "
            f"({writer.get('name_or_path', '?')}, {generated.get('backend')}, temperature "
            f"{sampling.get('temperature')}, max {sampling.get('max_new_tokens')} new tokens) "
            f"in {generated.get('dataset')}"
            + ("" if generated.get("complete", True) else f" (unfinished: {len(generated['units'])} units)")
        )
    return "\n".join(lines)


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f}"
