"""PNG plots of the inspection frames.

matplotlib's object API (``Figure``) is used instead of pyplot: no global backend or figure state is
touched, so this works headless, in threads and in notebooks alike. Each function returns the figure
and writes it when given a path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hsstore.extras import import_optional
from hsstore.inspect.health import StoreHealth, skip_set
from hsstore.inspect.layers import layer_stats, token_frame
from hsstore.inspect.samples import length_histogram, token_frequency

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from hsstore.store import Store


def _figure(width: float = 7.0, height: float = 4.0) -> Figure:
    figure = import_optional("matplotlib.figure", "hsstore.inspect's plots").Figure
    return figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: str | os.PathLike[str] | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    return fig


def plot_length_histogram(histogram: pd.DataFrame, path: str | os.PathLike[str] | None = None) -> Figure:
    """Bar chart of :func:`length_histogram`."""
    fig = _figure()
    ax = fig.add_subplot()
    ax.bar(histogram["lo"], histogram["count"], width=(histogram["hi"] - histogram["lo"]), align="edge", edgecolor="white")
    ax.set(xlabel="tokens per sample", ylabel="samples", title="sample lengths")
    return _save(fig, path)


def plot_token_frequency(frequency: pd.DataFrame, path: str | os.PathLike[str] | None = None) -> Figure:
    """Rank-frequency of loss-masked tokens (log-log) and the share a draft vocabulary of N ids covers."""
    fig = _figure(9.0, 3.6)
    left, right = fig.subplots(1, 2)
    ranks = np.arange(1, len(frequency) + 1)
    left.loglog(ranks, frequency["count_loss"].clip(lower=1))
    left.set(xlabel="rank", ylabel="loss-masked count", title="token frequency")
    right.semilogx(ranks, frequency["cum_share_loss"])
    right.set(xlabel="draft vocabulary size N", ylabel="share of loss tokens covered", ylim=(0, 1.02), title="draft vocab coverage")
    return _save(fig, path)


def plot_layer_stats(stats: pd.DataFrame, path: str | os.PathLike[str] | None = None) -> Figure:
    """Per layer: token norm (mean with std bars), max |x| and kurtosis: where the outliers are."""
    stats = stats[stats["num_tokens"] > 0]
    fig = _figure(10.0, 3.6)
    axes = fig.subplots(1, 3)
    labels = list(stats["layer"])
    x = np.arange(len(labels))
    axes[0].bar(x, stats["norm_mean"], yerr=stats["norm_std"], capsize=3)
    axes[0].set(title="token L2 norm", ylabel="norm")
    axes[1].bar(x, stats["max_abs"], color="tab:red")
    axes[1].set(title="max |x|")
    axes[2].bar(x, stats["kurtosis"], color="tab:purple")
    axes[2].set(title="excess kurtosis")
    for ax in axes:
        ax.set_xticks(x, labels)
    return _save(fig, path)


def plot_token_view(tokens: pd.DataFrame, path: str | os.PathLike[str] | None = None) -> Figure:
    """Per-token hidden-state norms of one sample (:func:`token_frame`), loss-masked spans shaded."""
    fig = _figure(10.0, 3.6)
    ax = fig.add_subplot()
    for column in [c for c in tokens.columns if c.startswith("norm_")]:
        ax.plot(tokens["position"], tokens[column], label=column.removeprefix("norm_"), linewidth=0.8)
    mask = tokens["loss_mask"].to_numpy().astype(bool)
    if mask.any():
        ax.fill_between(tokens["position"], 0, 1, where=mask, transform=ax.get_xaxis_transform(), alpha=0.12, color="green", label="loss mask")
    ax.set(xlabel="position", ylabel="L2 norm", yscale="log", title=f"sample {tokens.attrs.get('sample_id', '')}")
    ax.legend(fontsize="small", ncols=3)
    return _save(fig, path)


def plot_comparison(comparison: pd.DataFrame, path: str | os.PathLike[str] | None = None) -> Figure:
    """Per-layer relative error and 1 - mean cosine of :func:`compare_stores`."""
    fig = _figure(9.0, 3.6)
    left, right = fig.subplots(1, 2)
    labels = list(comparison["layer"])
    x = np.arange(len(labels))
    left.bar(x, comparison["rel_error"])
    left.set(title="relative error ||b-a|| / ||a||")
    right.bar(x, 1.0 - comparison["cosine_mean"], color="tab:orange")
    right.set(title="1 - mean cosine", yscale="log")
    for ax in (left, right):
        ax.set_xticks(x, labels)
    codecs_used = f"{comparison['codec_b'].iloc[0]} vs {comparison['codec_a'].iloc[0]}" if len(comparison) else ""
    fig.suptitle(codecs_used)
    return _save(fig, path)


def write_plots(
    store: Store,
    out_dir: str | os.PathLike[str],
    *,
    max_tokens: int = 4096,
    skip_shards: StoreHealth | set[str] | None = None,
) -> dict[str, Path]:
    """The standard PNGs of a store under ``out_dir``: lengths, token frequency, layer stats and the
    token view of the first readable sample. Returns name -> path."""
    out = Path(out_dir)
    skip = skip_set(skip_shards)
    paths = {
        "lengths": out / "length_histogram.png",
        "token_frequency": out / "token_frequency.png",
        "layer_stats": out / "layer_stats.png",
    }
    plot_length_histogram(length_histogram(store, skip_shards=skip), paths["lengths"])
    plot_token_frequency(token_frequency(store, top=None, skip_shards=skip), paths["token_frequency"])
    stats = layer_stats(store, max_tokens=max_tokens, skip_shards=skip)
    if len(stats) and "norm_mean" in stats:
        plot_layer_stats(stats, paths["layer_stats"])
    else:
        del paths["layer_stats"]
    first = _first_readable_sample(store, skip | set(stats.attrs.get("skipped_shards", {})))
    if first is not None:
        paths["token_view"] = out / "token_view.png"
        plot_token_view(token_frame(store, first, tokenizer=None), paths["token_view"])
    return paths


def _first_readable_sample(store: Store, skip: set[str]) -> int | None:
    start = 0
    for shard in store.shards:
        if shard.shard_id not in skip and shard.num_samples:
            return start
        start += shard.num_samples
    return None
