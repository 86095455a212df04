"""The whole picture of a store, as a JSON-ready dict (``hsstore inspect --json``) and as text."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from hsstore.inspect.health import StoreHealth, check_health
from hsstore.inspect.layers import layer_stats
from hsstore.inspect.samples import (
    bytes_per_token,
    column_values,
    length_histogram,
    loss_mask_coverage,
    token_frequency,
    vocab_coverage,
)
from hsstore.inspect.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import pandas as pd

    from hsstore.store import Store


def summary(
    store: Store,
    *,
    checksums: bool = True,
    verify: bool = True,
    max_tokens: int = 4096,
    bins: int = 20,
    top_tokens: int = 20,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Everything ``hsstore inspect`` shows, JSON-ready: ``info`` (lineage, features, codecs, bytes),
    ``health``, ``samples`` (counts, with and without damaged shards), ``length_histogram``,
    ``loss_mask``, ``token_frequency`` (+ ``vocab_coverage``), ``layer_stats``, ``bytes_per_token``.

    Damaged shards (found by verification, or failing on read) are left out of the statistics and
    named under ``health.bad_shards``. ``verify=False`` skips the up-front verification.
    """
    health = check_health(store, checksums=checksums) if verify else StoreHealth("none")
    frequency = token_frequency(store, top=None, skip_shards=health)
    stats = layer_stats(store, max_tokens=max_tokens, skip_shards=health)
    for part in (frequency, stats):
        for shard_id, why in part.attrs["skipped_shards"].items():
            if shard_id not in health.bad_shards:
                health.mark_bad(shard_id, why)
    lengths = column_values(store, "num_tokens", set(health.bad_shards))
    head = frequency.head(top_tokens).copy()
    decoder = load_tokenizer(store, tokenizer)
    if decoder is not None:
        head["token"] = [decoder.decode([int(i)]) for i in head["token_id"]]
    bad = set(health.bad_shards)
    return {
        "info": store.info(),
        "health": health.as_dict(),
        "samples": {
            "num_samples": store.num_samples,
            "num_tokens": store.num_tokens,
            "num_shards": len(store.shards),
            "inspected_samples": int(len(lengths)),
            "inspected_tokens": int(lengths.sum()),
            "excluded_samples": sum(s.num_samples for s in store.shards if s.shard_id in bad),
            "length_min": int(lengths.min()) if len(lengths) else 0,
            "length_mean": round(float(lengths.mean()), 2) if len(lengths) else 0.0,
            "length_p50": float(np.median(lengths)) if len(lengths) else 0.0,
            "length_max": int(lengths.max()) if len(lengths) else 0,
        },
        "length_histogram": records(length_histogram(store, bins=bins, skip_shards=bad)),
        "loss_mask": loss_mask_coverage(store, skip_shards=bad),
        "token_frequency": records(head),
        "distinct_tokens": int(len(frequency)),
        "vocab_coverage": {str(k): v for k, v in vocab_coverage(frequency).items()},
        "layer_stats": records(stats),
        "bytes_per_token": records(bytes_per_token(store)),
    }


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-ready rows: numpy scalars to Python, NaN/inf to None."""
    out = []
    for row in frame.to_dict(orient="records"):
        clean = {}
        for key, value in row.items():
            if isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            clean[str(key)] = value
        out.append(clean)
    return out


def format_summary(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`summary`."""
    from hsstore.info import format_info

    lines = [format_info(report["info"]), ""]
    health = report["health"]
    if health["ok"]:
        lines.append(f"health     OK ({health['checked']} verified"
                     + (f"; {health['num_unreferenced_files']} unreferenced file(s)" if health["num_unreferenced_files"] else "") + ")")
    else:
        lines.append(f"health     DAMAGED: {len(health['bad_shards'])} shard(s) left out of the statistics below")
        for shard_id, problems in health["bad_shards"].items():
            lines.append(f"  shard {shard_id}:")
            lines += [f"    {problem}" for problem in problems[:5]]
            if len(problems) > 5:
                lines.append(f"    ... and {len(problems) - 5} more")
        lines += [f"  {problem}" for problem in health["store_problems"]]
    s = report["samples"]
    lines += [
        "",
        f"inspected  {s['inspected_samples']:,} samples, {s['inspected_tokens']:,} tokens"
        + (f" ({s['excluded_samples']:,} samples in damaged shards excluded)" if s["excluded_samples"] else ""),
        f"lengths    min {s['length_min']:,}  mean {s['length_mean']:,.1f}  median {s['length_p50']:,.0f}  max {s['length_max']:,}",
        "",
        "length histogram (tokens per sample)",
    ]
    hist = report["length_histogram"]
    peak = max((row["count"] for row in hist), default=0)
    for row in hist:
        bar = "#" * (round(40 * row["count"] / peak) if peak else 0)
        lines.append(f"  {row['lo']:>8.0f} - {row['hi']:<8.0f} {row['count']:>7,} {bar}")
    loss = report["loss_mask"]
    q = loss["per_sample_fraction_quantiles"]
    lines += [
        "",
        f"loss mask  {loss['num_loss_tokens']:,} of {loss['num_tokens']:,} tokens ({100 * loss['loss_token_fraction']:.1f}%) are trained on; "
        f"{loss['samples_without_loss_tokens']:,} sample(s) have none",
    ]
    if q:
        lines.append("           per-sample share: " + "  ".join(f"{k} {v:.2f}" for k, v in q.items()))
    lines += ["", f"token frequency head (loss-masked; {report['distinct_tokens']:,} distinct ids seen)"]
    for row in report["token_frequency"]:
        token = f"  {row['token']!r}" if "token" in row else ""
        lines.append(f"  {row['token_id']:>8} {row['count_loss']:>10,} {100 * row['share_loss']:>6.2f}%{token}")
    if report["vocab_coverage"]:
        lines.append("  draft vocab of N ids covers: " + "  ".join(f"N={k}: {100 * v:.1f}%" for k, v in report["vocab_coverage"].items()))
    lines += ["", "hidden states per layer (norm = token L2 norm; kurtosis excess; outliers beyond 6 sigma)",
              f"  {'feature':<20}{'layer':<8}{'tokens':>8}{'norm mean':>11}{'norm std':>10}{'std':>9}{'max|x|':>9}"
              f"{'kurtosis':>10}{'>6sigma':>10}  top channels (max|x|)"]
    for row in report["layer_stats"]:
        if not row.get("num_tokens"):
            lines.append(f"  {row['feature']:<20}{row['layer']:<8}{0:>8}")
            continue
        tops = ", ".join(f"{c} ({v:g})" for c, v in zip(row["top_channels"][:3], row["top_channel_max_abs"][:3], strict=False))
        lines.append(
            f"  {row['feature']:<20}{row['layer']:<8}{row['num_tokens']:>8,}{row['norm_mean']:>11.2f}{row['norm_std']:>10.2f}"
            f"{row['std']:>9.3f}{row['max_abs']:>9.2f}{row['kurtosis']:>10.2f}{100 * row['frac_6sigma']:>9.3f}%  {tops}"
        )
    lines += ["", "bytes per token"]
    for row in report["bytes_per_token"]:
        raw = f"  (raw {row['raw_bytes_per_token']:,})" if row["raw_bytes_per_token"] else ""
        lines.append(f"  {row['part']:<22}{row['codec']:<10}{row['compression']:<10}{row['bytes_per_token']:>10,.1f}{raw}")
    return "\n".join(lines)
