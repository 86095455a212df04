"""What the side-by-side benchmarks compare drafts by: acceptance lengths (a chain of 5 and the
EAGLE-2 tree 8/5/31 at temperature 0, and the tree at temperature 1: lossless rejection sampling,
seed 0), decoded against the target in float32 with no target-only baseline; and the per-depth
accuracy on a held-out store (hsstore's offline proxy, the same code for every draft)."""

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


def heldout_accuracy(draft: Path, *, store: Path, target: Path, device: str, max_samples: int) -> list[float]:
    """Per-depth TTT accuracy of ``draft`` (an export or a checkpoint's draft) on the held-out
    ``store``: the offline proxy over its first ``max_samples`` samples, 7 depths, float32."""
    import torch

    from pipelines.evaluate.proxy import offline_proxy
    from pipelines.evaluate.recipe import ProxyConfig
    from pipelines.models.checkpoint import load_draft
    from pipelines.train.target_heads import load_target_heads

    embed = load_target_heads(str(target)).embed_tokens_VH.to(torch.float32)
    model = load_draft(draft, device=torch.device(device), dtype=torch.float32, embed_tokens=embed).eval()
    config = ProxyConfig(store=str(store), fraction=1.0, max_samples=max_samples, ttt_length=7)
    with torch.no_grad():
        return offline_proxy(model, config, str(target), [], torch.device(device))["accuracy_per_depth"]
