"""Views of the sample table: per-sample frame, lengths, loss-mask coverage, token frequency, bytes.

These read only the Arrow sample tables (ids, masks, counts), never the feature arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hsstore.inspect.health import StoreHealth, readable_tables, skip_set
from hsstore.inspect.tokenizer import load_tokenizer, require_tokenizer

if TYPE_CHECKING:
    import pandas as pd

    from hsstore.store import Store


def samples_frame(
    store: Store,
    *,
    decode_text: bool = False,
    tokenizer: Any = "auto",
    with_tokens: bool = False,
    skip_shards: StoreHealth | set[str] | None = None,
) -> pd.DataFrame:
    """One row per sample: ids, shard/row, ``num_tokens``, ``num_loss_tokens``, ``loss_fraction``.

    ``decode_text=True`` adds ``text`` (the tokenizer named by the lineage, or ``tokenizer``);
    ``with_tokens=True`` keeps the ``input_ids``/``loss_mask`` lists.
    """
    import pandas as pd

    tables, skipped = readable_tables(store, skip_set(skip_shards))
    columns = ["sample_id", "source_id", "num_tokens", "num_loss_tokens", "token_offset"]
    if with_tokens or decode_text:
        columns += ["input_ids", "loss_mask"]
    frames = []
    for shard, table in tables:
        frame = table.select(columns).to_pandas()
        frame.insert(2, "shard_id", shard.shard_id)
        frame.insert(3, "row", np.arange(len(frame), dtype=np.int32))
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    frame["loss_fraction"] = frame["num_loss_tokens"] / frame["num_tokens"].where(frame["num_tokens"] > 0)
    if decode_text:
        decoder = require_tokenizer(store, tokenizer)
        frame["text"] = decoder.batch_decode([list(ids) for ids in frame["input_ids"]])
        if not with_tokens:
            frame = frame.drop(columns=["input_ids", "loss_mask"])
    frame.attrs["skipped_shards"] = skipped
    return frame


def length_histogram(store: Store, *, bins: int = 20, skip_shards: StoreHealth | set[str] | None = None) -> pd.DataFrame:
    """Sample lengths in ``bins`` equal-width bins: columns ``lo``, ``hi`` (token counts) and ``count``."""
    import pandas as pd

    lengths = column_values(store, "num_tokens", skip_set(skip_shards))
    if len(lengths) == 0:
        return pd.DataFrame({"lo": [], "hi": [], "count": []})
    counts, edges = np.histogram(lengths, bins=bins, range=(0, max(1, int(lengths.max()))))
    return pd.DataFrame({"lo": edges[:-1], "hi": edges[1:], "count": counts})


def loss_mask_coverage(store: Store, *, skip_shards: StoreHealth | set[str] | None = None) -> dict[str, Any]:
    """How much of the store is trained on: the loss-masked share of tokens, and samples without any."""
    skip = skip_set(skip_shards)
    lengths = column_values(store, "num_tokens", skip)
    loss = column_values(store, "num_loss_tokens", skip)
    total, masked = int(lengths.sum()), int(loss.sum())
    fractions = loss[lengths > 0] / lengths[lengths > 0]
    names = ("min", "p25", "p50", "p75", "max")
    quantiles = np.quantile(fractions, [0.0, 0.25, 0.5, 0.75, 1.0]).round(4).tolist() if len(fractions) else []
    return {
        "num_tokens": total,
        "num_loss_tokens": masked,
        "loss_token_fraction": round(masked / total, 4) if total else 0.0,
        "samples_without_loss_tokens": int((loss == 0).sum()),
        "per_sample_fraction_quantiles": dict(zip(names, quantiles, strict=False)),  # empty for an empty store
    }


def token_frequency(
    store: Store,
    *,
    top: int | None = 20,
    tokenizer: Any = None,
    skip_shards: StoreHealth | set[str] | None = None,
) -> pd.DataFrame:
    """Token ids by loss-masked frequency (what draft-vocabulary calibration counts), most frequent
    first: ``token_id``, ``count_loss``, ``count_all``, ``share_loss``, ``cum_share_loss`` and, with a
    tokenizer (``"auto"`` for the lineage's), ``token``. ``top=None`` keeps every id seen."""
    import pandas as pd

    tables, skipped = readable_tables(store, skip_set(skip_shards))
    vocab = store.lineage.target.vocab_size if store.lineage.target else 0
    count_all = np.zeros(vocab, dtype=np.int64)
    count_loss = np.zeros(vocab, dtype=np.int64)
    for _, table in tables:
        ids = _flat(table, "input_ids").astype(np.int64)
        mask = _flat(table, "loss_mask").astype(bool)
        if len(ids) and ids.max() >= len(count_all):
            grow = int(ids.max()) + 1 - len(count_all)
            count_all, count_loss = np.pad(count_all, (0, grow)), np.pad(count_loss, (0, grow))
        count_all += np.bincount(ids, minlength=len(count_all))
        count_loss += np.bincount(ids[mask], minlength=len(count_loss))
    seen = np.flatnonzero(count_all)
    order = seen[np.lexsort((seen, -count_all[seen], -count_loss[seen]))]
    total_loss = max(1, int(count_loss.sum()))
    frame = pd.DataFrame(
        {
            "token_id": order,
            "count_loss": count_loss[order],
            "count_all": count_all[order],
            "share_loss": count_loss[order] / total_loss,
        }
    )
    frame["cum_share_loss"] = frame["share_loss"].cumsum()
    if top is not None:
        frame = frame.head(top).copy()
    decoder = load_tokenizer(store, tokenizer)
    if decoder is not None:
        frame["token"] = [decoder.decode([int(i)]) for i in frame["token_id"]]
    frame.attrs["skipped_shards"] = skipped
    return frame


def vocab_coverage(frequency: pd.DataFrame, sizes: tuple[int, ...] = (256, 1024, 4096, 32000)) -> dict[int, float]:
    """Share of loss-masked tokens a draft vocabulary of the N most frequent ids would cover.

    ``frequency`` is :func:`token_frequency` with ``top=None``; sizes past the ids seen cover 1.0."""
    cumulative = frequency["cum_share_loss"].to_numpy()
    if len(cumulative) == 0:
        return {}
    return {size: round(float(cumulative[min(size, len(cumulative)) - 1]), 4) for size in sizes}


def bytes_per_token(store: Store) -> pd.DataFrame:
    """On-disk bytes per token of each feature and of the sample table, against the raw codec size."""
    import pandas as pd

    info = store.info()
    rows = [
        {
            "part": name,
            "codec": feature["codec"],
            "compression": feature["compression"],
            "bytes_per_token": feature["bytes_per_token"],
            "raw_bytes_per_token": feature["raw_bytes_per_token"],
        }
        for name, feature in info["features"].items()
    ]
    tokens = max(1, info["num_tokens"])
    rows.append({"part": "sample table", "codec": "arrow", "compression": "none",
                 "bytes_per_token": round(info["sample_table_bytes"] / tokens, 2), "raw_bytes_per_token": None})
    rows.append({"part": "total", "codec": "", "compression": "",
                 "bytes_per_token": info["bytes_per_token"], "raw_bytes_per_token": None})
    return pd.DataFrame(rows)


def _flat(table: pa.Table, column: str) -> np.ndarray:
    values = pc.list_flatten(table.column(column))
    return np.asarray(values.to_numpy(zero_copy_only=False))


def column_values(store: Store, column: str, skip: set[str]) -> np.ndarray:
    tables, _ = readable_tables(store, skip)
    parts = [np.asarray(table.column(column).to_numpy(), dtype=np.int64) for _, table in tables]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
