"""``hsstore generate RECIPE [--set KEY=VALUE]...``: argparse only; the work imports lazily."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipelines.recipe import add_recipe_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="the target answers a dataset's prompts: training data for extract (resumes when rerun)",
        description=(
            "Regenerate the answers of the recipe's data with the target (or an OpenAI-compatible "
            "server) and write a dataset that hsstore extract reads as it is. Rerunning the same "
            "recipe resumes: committed units are skipped."
        ),
    )
    add_recipe_arguments(
        parser, "recipes/reference/generate.yaml", "--set limit=16 --set sampling.max_new_tokens=64"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.generate import run_generation
    from pipelines.generate.recipe import GenerateRecipe
    from pipelines.recipe import load_recipe

    recipe = load_recipe(GenerateRecipe, args.recipe, args.overrides)
    summary = run_generation(recipe, progress=not args.no_progress and sys.stderr.isatty())
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(summary.format())
    # Stopped by SIGTERM/SIGINT: the shell's convention, 128 + the signal (143, 130).
    return 0 if summary.stopped_by_signal is None else 128 + summary.stopped_by_signal
