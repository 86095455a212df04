"""Helpers for the end-to-end extraction tests: recipes, reference forwards, store read-back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hsstore
from pipelines.extract.planner import StreamPlanner, WindowPlan
from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.records import Rejection
from pipelines.extract.units import SampleRow
from pipelines.recipe import build_recipe


def make_recipe(target: Path, data: list[Path], store: Path, **sections: Any) -> ExtractRecipe:
    """A small CPU recipe: tiny units and budgets so a few records span several shards/batches."""
    raw: dict[str, Any] = {
        "target": str(target),
        "data": [str(p) for p in data],
        "store": str(store),
        "executor": "local",
        "model": {"dtype": "float32", "device": "cpu"},
        "capture": {"aux_layer_ids": [0, 2, 4]},
        "batching": {"max_length": 256, "token_budget": 512, "too_long": "truncate"},
        "units": {"max_tokens": 64},
        # Small inner chunks: a last, partly filled chunk is stored whole.
        "codecs": {"chunk_bytes": 16384},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return build_recipe(ExtractRecipe, raw)


@dataclass
class Plan:
    """What the streaming planner (the path ``hsstore extract`` takes) made of a recipe's data."""

    windows: list[WindowPlan]
    rejected_by_reason: dict[str, int]

    @property
    def samples(self) -> list[SampleRow]:
        """The accepted samples in input order (units hold them length-sorted per window)."""
        rows = {row.sample_id: row for w in self.windows for u in w.units for row in u.rows}
        return [rows[sample_id] for w in self.windows for sample_id, _ in w.samples]

    @property
    def rejections(self) -> list[Rejection]:
        return [r for w in self.windows for r in w.rejections]

    @property
    def num_records(self) -> int:
        return sum(w.num_records for w in self.windows)

    @property
    def num_truncated(self) -> int:
        return sum(w.num_truncated for w in self.windows)


def plan_recipe(recipe: ExtractRecipe) -> Plan:
    """Plan ``recipe`` as an extraction does (no journal, nothing written)."""
    from pipelines.extract.tokenizer_pool import make_sample_tokenizer

    tokenizer_dir = recipe.tokenizer.path or recipe.target
    planner = StreamPlanner(recipe, make_sample_tokenizer(recipe, tokenizer_dir), tokenizer_dir)
    windows = list(planner.windows())
    return Plan(windows, dict(sorted(planner.rejected.items())))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-token relative L2 error."""
    actual_TD = actual.float().reshape(actual.shape[0], -1)
    expected_TD = expected.float().reshape(expected.shape[0], -1)
    error_T = (actual_TD - expected_TD).norm(dim=-1) / expected_TD.norm(dim=-1).clamp_min(1e-6)
    return float(error_T.max())


def stored_samples(store_url: str | Path) -> dict[str, dict[str, Any]]:
    """Every stored sample by source id: ids, mask, features (torch, logical dtype)."""
    store = hsstore.open_store(str(store_url))
    table = store.samples
    out = {}
    for index in range(store.num_samples):
        sample = store.read_sample(index)
        sample["sample_id"] = table["sample_id"][index].as_py()
        out[table["source_id"][index].as_py()] = sample
    return out


def plain_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``output_hidden_states`` of an unbatched forward of the whole causal LM."""
    with torch.inference_mode():
        out = model(input_ids=input_ids.reshape(1, -1).long(), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def fatal_problems(store_url: str | Path) -> list[str]:
    from hsstore.storage import StoreLocation
    from hsstore.verify import verify_store

    return [str(p) for p in verify_store(StoreLocation(str(store_url))) if p.fatal]


def as_array(value: Any) -> np.ndarray:
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
