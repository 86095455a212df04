"""``hsstore extract RECIPE [--set KEY=VALUE]...``: argparse only; the work imports lazily."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipelines.recipe import add_recipe_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "extract",
        help="run the target over a dataset and fill a store (resumes when rerun)",
        description=(
            "Run the target model over the recipe's data and write its hidden states into the "
            "store. Rerunning the same recipe resumes: committed units are skipped."
        ),
    )
    add_recipe_arguments(parser, "recipes/reference/extract.yaml", "--set limit=100 --set executor=local")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="plan only: read and tokenize every record, cut the units, print records, samples, "
        "tokens, rejects by reason and units; load no model, write nothing",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.extract import run_extraction
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    recipe = load_recipe(ExtractRecipe, args.recipe, args.overrides)
    summary = run_extraction(
        recipe, progress=not args.no_progress and sys.stderr.isatty(), dry_run=args.dry_run
    )
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(summary.format())
    return 0
