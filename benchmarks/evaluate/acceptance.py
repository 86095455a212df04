"""The acceptance lengths the side-by-side benchmarks compare drafts by: a chain of 5 and the
EAGLE-2 tree 8/5/31 at temperature 0, and the tree at temperature 1 (lossless rejection sampling,
seed 0), decoded against the target in float32 with no target-only baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SETTINGS: list[dict[str, Any]] = [
    {"name": "chain5_t0", "num_draft_tokens": 5},
    {"name": "tree_t0", "draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31},
    {"name": "tree_t1", "draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31, "temperature": 1.0},
]


def acceptance_lengths(
    draft: Path,
    *,
    target: Path,
    prompts: Path,
    out: Path,
    limit: int,
    max_new_tokens: int,
    device: str,
    settings: list[dict[str, Any]] = SETTINGS,
) -> dict[str, float]:
    """``{"al_<setting>": acceptance length}`` of ``draft`` for each setting."""
    from pipelines.evaluate.recipe import EvaluateRecipe
    from pipelines.evaluate.runner import run_evaluation
    from pipelines.recipe import build_recipe

    recipe = build_recipe(
        EvaluateRecipe,
        {
            "target": str(target),
            "draft": str(draft),
            "prompts": str(prompts),
            "output_dir": str(out),
            "limit": limit,
            "max_new_tokens": max_new_tokens,
            "settings": settings,
            "dtype": "float32",
            "device": device,
            "baseline": False,
            "seed": 0,
        },
    )
    results = run_evaluation(recipe)
    return {f"al_{s['name']}": s["acceptance_length"] for s in results["settings"]}
