"""Looking at a store: what it holds, how its features are distributed, and how two stores differ.

Functions return plain dicts or pandas DataFrames, so that a notebook can slice and plot them;
``hsstore inspect`` prints the same numbers (:func:`summary`, :func:`format_summary`)::

    import hsstore
    from hsstore import inspect as hi

    store = hsstore.open_store("runs/reference/store")
    report = hi.summary(store)                        # everything, JSON-ready
    frame = hi.samples_frame(store, decode_text=True) # one row per sample, text via the lineage's tokenizer
    tokens = hi.token_frame(store, 0)                 # one row per token of sample 0
    stats = hi.layer_stats(store)                     # per-layer norms and outliers
    errors = hi.compare_stores(bf16_store, fp8_store) # per-layer codec error
    hi.write_plots(store, "plots/")                   # PNGs

A store with a damaged shard stays inspectable: :func:`check_health` names the shard and the other
functions leave it out (``skip_shards=``), also skipping any shard that fails on read, and list what
they skipped in ``DataFrame.attrs["skipped_shards"]``.

Imports stay light (numpy, pyarrow): pandas and matplotlib load inside the functions that need them,
transformers only to decode text.
"""

from hsstore.inspect.health import StoreHealth, check_health
from hsstore.inspect.layers import (
    HIDDEN_FEATURES,
    OUTLIER_SIGMA,
    compare_stores,
    layer_labels,
    layer_stats,
    token_frame,
)
from hsstore.inspect.plots import (
    plot_comparison,
    plot_layer_stats,
    plot_length_histogram,
    plot_token_frequency,
    plot_token_view,
    write_plots,
)
from hsstore.inspect.report import format_summary, summary
from hsstore.inspect.samples import (
    bytes_per_token,
    length_histogram,
    loss_mask_coverage,
    samples_frame,
    token_frequency,
    vocab_coverage,
)
from hsstore.inspect.tokenizer import find_tokenizer_dir, load_tokenizer

__all__ = [
    "HIDDEN_FEATURES",
    "OUTLIER_SIGMA",
    "StoreHealth",
    "bytes_per_token",
    "check_health",
    "compare_stores",
    "find_tokenizer_dir",
    "format_summary",
    "layer_labels",
    "layer_stats",
    "length_histogram",
    "load_tokenizer",
    "loss_mask_coverage",
    "plot_comparison",
    "plot_layer_stats",
    "plot_length_histogram",
    "plot_token_frequency",
    "plot_token_view",
    "samples_frame",
    "summary",
    "token_frequency",
    "token_frame",
    "vocab_coverage",
    "write_plots",
]
