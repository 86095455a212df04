"""Real speculative decoding (chain and EAGLE-2 trees) measuring acceptance length.

Python use::

    from pipelines.evaluate import EvaluateRecipe, run_evaluation
    from pipelines.recipe import load_recipe

    recipe = load_recipe(EvaluateRecipe, "recipes/reference/evaluate.yaml", ["limit=10"])
    results = run_evaluation(recipe)
    results["acceptance_length"]

Importing this package is light (pydantic only); torch and transformers load when a run starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipelines.evaluate.recipe import DecodeSetting, EvaluateRecipe, ProxyConfig

if TYPE_CHECKING:
    from pipelines.evaluate.runner import run_evaluation as run_evaluation


def __getattr__(name: str) -> Any:
    if name == "run_evaluation":
        from pipelines.evaluate.runner import run_evaluation

        return run_evaluation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DecodeSetting", "EvaluateRecipe", "ProxyConfig", "run_evaluation"]
