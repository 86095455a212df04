"""``hsstore train RECIPE [--set KEY=VALUE]...``: argparse only; torch is imported by the handler.

Multi-process (DDP): ``torchrun --nproc_per_node N -m pipelines.cli train RECIPE`` (or the
``hsstore`` script path in place of ``-m pipelines.cli``): every rank runs the same command.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipelines.recipe import add_recipe_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train an EAGLE-3/EAGLE-4 draft or a candidate head from a store",
        description=(
            "Stream packed batches from the store and fit a draft (stage: draft) or a low-rank "
            "candidate head on a frozen draft (stage: candidate_head). Rerunning with the same "
            "output_dir resumes from its newest checkpoint. The final checkpoint's path is printed."
        ),
    )
    add_recipe_arguments(parser, "recipes/reference/train-eagle3.yaml", "--set max_steps=20 --set loader.token_budget=2048")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.recipe import load_recipe
    from pipelines.train.config import TrainRecipe
    from pipelines.train.trainer import run_training

    recipe = load_recipe(TrainRecipe, args.recipe, args.overrides)
    summary = run_training(recipe)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0
