"""The sweep's plot: a metric against one swept key, every point shown, the mean per value joined."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


def plot_metric(results: pd.DataFrame, key: str, metric: str, path: str | Path | None = None) -> Figure:
    """``metric`` against the values of ``key``; other keys vary within each column of dots.

    Numeric values keep their spacing; anything else (null, strings, lists) is placed in grid order.
    """
    from matplotlib.figure import Figure

    done = results[results[metric].notna()]
    values = list(dict.fromkeys(done[key].map(_hashable)))
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    position = {v: (float(v) if numeric else i) for i, v in enumerate(values)}
    xs = [position[_hashable(v)] for v in done[key]]
    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    ax.scatter(xs, done[metric], alpha=0.6, label="points")
    means = done.assign(_x=xs).groupby("_x")[metric].mean().sort_index()
    ax.plot(means.index, means.to_numpy(), marker="o", color="black", label="mean")
    if not numeric:
        ax.set_xticks(range(len(values)), [str(v) for v in values])
    ax.set(xlabel=key, ylabel=metric, title=f"{metric} vs {key} ({len(done)} points)")
    ax.legend(fontsize="small")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    return fig


def _hashable(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, list | dict) else value
