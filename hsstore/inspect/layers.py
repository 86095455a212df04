"""Views of the hidden-state features: per-token norms, per-layer outlier statistics, store comparisons.

Layers are labelled ``h<i>`` for aux layer id ``i`` (the hidden state entering decoder layer ``i``,
``hidden_states[i]`` in transformers) and ``final`` for the post-norm final state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from hsstore.aux_layers import AUX_HIDDEN_STATES, FINAL_HIDDEN_STATE
from hsstore.errors import HsstoreError, ShardCorruptError
from hsstore.format import codecs
from hsstore.inspect.health import StoreHealth, skip_set
from hsstore.inspect.samples import samples_frame
from hsstore.inspect.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import pandas as pd

    from hsstore.store import Store

HIDDEN_FEATURES = (AUX_HIDDEN_STATES, FINAL_HIDDEN_STATE)
# Activation outliers in LLMs are conventionally counted beyond 6 standard deviations (LLM.int8()).
OUTLIER_SIGMA = 6.0


def layer_labels(store: Store, feature: str) -> list[str]:
    """Labels of a hidden-state feature's layers: ``h<i>`` per aux layer id, ``final`` for the final state."""
    spec = store.features[feature]
    if feature == FINAL_HIDDEN_STATE or len(spec.shape) == 1:
        return ["final" if feature == FINAL_HIDDEN_STATE else feature]
    ids = store.lineage.aux_layer_ids
    if feature == AUX_HIDDEN_STATES and len(ids) == spec.shape[0]:
        return [f"h{i}" for i in ids]
    return [f"{feature}[{k}]" for k in range(spec.shape[0])]


def per_layer(values: np.ndarray) -> list[np.ndarray]:
    """[T, K, H] -> K arrays [T, H]; [T, H] -> one."""
    return [values] if values.ndim == 2 else [values[:, k] for k in range(values.shape[1])]


def token_frame(store: Store, index: int, *, tokenizer: Any = "auto") -> pd.DataFrame:
    """Per-token view of sample ``index``: ``position``, ``token_id``, ``token`` (when a tokenizer is
    found), ``loss_mask`` and, per layer, the hidden state's L2 norm (``norm_<label>``) and max |x|."""
    import pandas as pd

    names = [name for name in HIDDEN_FEATURES if name in store.features]
    sample = store.read_sample(index, names, as_numpy=True)
    frame = pd.DataFrame(
        {
            "position": np.arange(len(sample["input_ids"])),
            "token_id": sample["input_ids"],
            "loss_mask": sample["loss_mask"],
        }
    )
    decoder = load_tokenizer(store, tokenizer)
    if decoder is not None:
        frame.insert(2, "token", [decoder.decode([int(i)]) for i in sample["input_ids"]])
    for name in names:
        for label, layer in zip(layer_labels(store, name), per_layer(sample[name]), strict=True):
            frame[f"norm_{label}"] = np.linalg.norm(layer.astype(np.float64), axis=-1)
            frame[f"maxabs_{label}"] = np.abs(layer).max(axis=-1) if layer.shape[0] else []
    frame.attrs.update(sample_id=sample["sample_id"], source_id=sample["source_id"])
    return frame


def _read_spread(
    store: Store, names: list[str], max_tokens: int, skip: set[str]
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Decoded values of up to ``max_tokens`` tokens, taken as a prefix of every readable shard in
    equal shares, so that one shard does not stand for the whole store."""
    shards = [s for s in store.shards if s.shard_id not in skip and s.num_tokens > 0]
    skipped = {sid: "listed as damaged" for sid in skip}
    share = math.ceil(max_tokens / max(1, len(shards)))
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for shard in shards:
        stop = min(shard.num_tokens, share)
        try:
            raw = store.read_token_range(shard.shard_id, 0, stop, names)
            decoded = {name: codecs.decode_numpy(store.features[name], raw) for name in names}
        except ShardCorruptError as err:
            skipped[shard.shard_id] = str(err)
            continue
        for name in names:
            parts[name].append(decoded[name])
    values = {
        name: np.concatenate(chunks)[:max_tokens] if chunks else np.zeros((0, *store.features[name].shape), np.float32)
        for name, chunks in parts.items()
    }
    return values, skipped


def layer_stats(
    store: Store,
    *,
    max_tokens: int = 4096,
    features: list[str] | None = None,
    top_channels: int = 5,
    skip_shards: StoreHealth | set[str] | None = None,
) -> pd.DataFrame:
    """Per-layer hidden-state statistics over up to ``max_tokens`` tokens (spread over the shards).

    Columns: ``feature``, ``layer``, ``num_tokens``; token L2 norm ``norm_mean``/``norm_std``/
    ``norm_max``; value ``mean``, ``std``, ``max_abs``, excess ``kurtosis`` (0 for a Gaussian; heavy
    tails mean outliers), ``frac_6sigma`` (share of values beyond 6 std); ``top_channels`` (channels
    with the largest max |x|), their ``top_channel_max_abs``, and ``channel_rms_ratio`` (largest over
    median channel RMS: how much one channel dominates, what makes fp8's per-row scale lossy).
    Memory is about ``max_tokens * values_per_token * 8`` bytes.
    """
    import pandas as pd

    names = features or [name for name in HIDDEN_FEATURES if name in store.features]
    values, skipped = _read_spread(store, names, max_tokens, skip_set(skip_shards))
    rows = []
    for name in names:
        for label, layer in zip(layer_labels(store, name), per_layer(values[name]), strict=True):
            rows.append({"feature": name, "layer": label, **_stats(layer.astype(np.float64), top_channels)})
    frame = pd.DataFrame(rows)
    frame.attrs["skipped_shards"] = skipped
    return frame


def _stats(x_TH: np.ndarray, top_channels: int) -> dict[str, Any]:
    if x_TH.shape[0] == 0:
        return {"num_tokens": 0}
    norms = np.linalg.norm(x_TH, axis=-1)
    mean, std = float(x_TH.mean()), float(x_TH.std())
    centred = (x_TH - mean) / std if std > 0 else np.zeros_like(x_TH)
    channel_max = np.abs(x_TH).max(axis=0)
    channel_rms = np.sqrt((x_TH**2).mean(axis=0))
    top = np.argsort(-channel_max, kind="stable")[:top_channels]
    median_rms = float(np.median(channel_rms))
    return {
        "num_tokens": int(x_TH.shape[0]),
        "norm_mean": float(norms.mean()),
        "norm_std": float(norms.std()),
        "norm_max": float(norms.max()),
        "mean": mean,
        "std": std,
        "max_abs": float(channel_max.max()),
        "kurtosis": float((centred**4).mean() - 3.0) if std > 0 else 0.0,
        "frac_6sigma": float((np.abs(centred) > OUTLIER_SIGMA).mean()),
        "top_channels": [int(c) for c in top],
        "top_channel_max_abs": [round(float(channel_max[c]), 4) for c in top],
        "channel_rms_ratio": float(channel_rms.max() / median_rms) if median_rms > 0 else float("inf"),
    }


def compare_stores(a: Store, b: Store, *, max_tokens: int = 16384, features: list[str] | None = None) -> pd.DataFrame:
    """Per-layer error of store ``b`` against reference ``a`` over their common sample ids (e.g. fp8
    against bf16 of the same extraction).

    Columns: ``feature``, ``layer``, ``codec_a``, ``codec_b``, ``num_tokens``, ``rel_error``
    (||b-a|| / ||a|| over all values), ``cosine_mean``/``cosine_min`` (per token), ``max_abs_error``,
    ``mean_abs_error``. Samples whose ``input_ids`` differ are skipped and counted in
    ``attrs["mismatched_samples"]``: the stores did not tokenise the same input.
    """
    import pandas as pd

    names = features or [n for n in HIDDEN_FEATURES if n in a.features and n in b.features]
    for name in names:
        if name not in a.features or name not in b.features or a.features[name].shape != b.features[name].shape:
            raise HsstoreError(f"feature {name!r} is missing from one store or has another shape ({a.url} vs {b.url})")
    frame_a = samples_frame(a, skip_shards=None)
    frame_b = samples_frame(b, skip_shards=None)
    index_b = dict(zip(frame_b["sample_id"], range(len(frame_b)), strict=True))
    starts_a = _global_starts(a)
    starts_b = _global_starts(b)
    acc: dict[tuple[str, int], _ErrorAccumulator] = {}
    num_common = mismatched = used_tokens = 0
    for row_a in frame_a.itertuples(index=False):
        j = index_b.get(row_a.sample_id)
        if j is None or used_tokens >= max_tokens:
            continue
        num_common += 1
        row_b = frame_b.iloc[j]
        sample_a = a.read_sample(starts_a[row_a.shard_id] + row_a.row, names, as_numpy=True)
        sample_b = b.read_sample(starts_b[row_b["shard_id"]] + int(row_b["row"]), names, as_numpy=True)
        if not np.array_equal(sample_a["input_ids"], sample_b["input_ids"]):
            mismatched += 1
            continue
        take = min(len(sample_a["input_ids"]), max_tokens - used_tokens)
        used_tokens += take
        for name in names:
            for k, (la, lb) in enumerate(zip(per_layer(sample_a[name][:take]), per_layer(sample_b[name][:take]), strict=True)):
                acc.setdefault((name, k), _ErrorAccumulator()).add(la, lb)
    rows = []
    for name in names:
        for k, label in enumerate(layer_labels(a, name)):
            stats = acc.get((name, k), _ErrorAccumulator()).result()
            rows.append({"feature": name, "layer": label, "codec_a": a.features[name].codec,
                         "codec_b": b.features[name].codec, **stats})
    frame = pd.DataFrame(rows)
    frame.attrs.update(common_samples=num_common, mismatched_samples=mismatched,
                       skipped_shards={**frame_a.attrs["skipped_shards"], **frame_b.attrs["skipped_shards"]})
    return frame


def _global_starts(store: Store) -> dict[str, int]:
    starts, total = {}, 0
    for shard in store.shards:
        starts[shard.shard_id] = total
        total += shard.num_samples
    return starts


class _ErrorAccumulator:
    """Running sums for error statistics, so that comparisons stream sample by sample."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.sq_err = self.sq_ref = self.abs_err = 0.0
        self.max_abs = 0.0
        self.num_values = 0
        self.cosines: list[np.ndarray] = []

    def add(self, a_TH: np.ndarray, b_TH: np.ndarray) -> None:
        a64, b64 = a_TH.astype(np.float64), b_TH.astype(np.float64)
        err = b64 - a64
        self.num_tokens += a64.shape[0]
        self.num_values += err.size
        self.sq_err += float((err**2).sum())
        self.sq_ref += float((a64**2).sum())
        self.abs_err += float(np.abs(err).sum())
        self.max_abs = max(self.max_abs, float(np.abs(err).max()) if err.size else 0.0)
        denom = np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1)
        dots = (a64 * b64).sum(axis=-1)
        # An all-zero row in both stores is identical: cosine 1 by convention.
        self.cosines.append(np.where(denom > 0, dots / np.where(denom > 0, denom, 1.0), 1.0))

    def result(self) -> dict[str, Any]:
        cos = np.concatenate(self.cosines) if self.cosines else np.zeros(0)
        return {
            "num_tokens": self.num_tokens,
            "rel_error": math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref > 0 else float("nan"),
            "cosine_mean": float(cos.mean()) if len(cos) else float("nan"),
            "cosine_min": float(cos.min()) if len(cos) else float("nan"),
            "max_abs_error": self.max_abs,
            "mean_abs_error": self.abs_err / self.num_values if self.num_values else float("nan"),
        }
