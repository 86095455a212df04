"""A tiny training recipe for sweeps over the session's reference store (tests/conftest.py)."""

from __future__ import annotations

from typing import Any

from tests.support.paths import REFERENCE_TARGET


def tiny_train_base(store: str, **extra: Any) -> dict[str, Any]:
    """An EAGLE-4 training recipe small enough that one point trains in a few seconds on a CPU.

    The row holds a whole sample of the reference store (256 tokens): a shorter row truncates a
    chat to its prompt, whose loss mask is empty, and a one-step point then scores nothing (the
    store's order, and so which sample comes first, follows the extraction's commit order)."""
    base: dict[str, Any] = {
        "store": store,
        "target": str(REFERENCE_TARGET),
        "output_dir": "set-by-the-sweep",
        "model": "eagle4",
        "max_steps": 1,
        "ttt_length": 2,
        "verify_weights": False,
        "device": "cpu",
        "draft": {"intermediate_size": 128, "sliding_window": 8, "vocab": {"draft_vocab_size": 256}},
        "loader": {"token_budget": 256, "shuffle_window": 16, "long_samples": "truncate", "read_threads": 1},
        "schedule": {"warmup_steps": 1},
        "log_every": 1,
    }
    base.update(extra)
    return base
