"""``hsstore sweep RECIPE [--grid KEY=V1,V2 ...] [--set KEY=VALUE ...]``: argparse only."""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.recipe import add_recipe_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="train (and evaluate) one draft per grid point from the same store; resumable",
        description=(
            "Train one draft per point of a grid over a base training recipe, all from the same "
            "store, in sequence or as Ray tasks; optionally evaluate each. Writes results.parquet, "
            "results.csv and plots under the sweep's output_dir. A rerun skips finished points."
        ),
    )
    add_recipe_arguments(parser, "recipes/reference/sweep.yaml", "--set executor=ray --set overrides.max_steps=20")
    parser.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2",
        help="sweep a dotted TrainRecipe key over comma-separated YAML values (replaces the recipe's "
        "grid entry for KEY); repeat for a product",
    )
    parser.add_argument("--executor", choices=["sequential", "ray"], help="shorthand for --set executor=...")
    parser.add_argument("--dry-run", action="store_true", help="list the points and their status, train nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.sweep.recipe import expand, load_sweep_recipe, parse_grid_args

    overrides = list(args.overrides) + ([f"executor={args.executor}"] if args.executor else [])
    recipe = load_sweep_recipe(args.recipe, overrides, parse_grid_args(args.grid))
    if args.dry_run:
        from pathlib import Path

        points = expand(recipe)
        for point in points:
            done = (Path(recipe.output_dir) / "points" / point.name / "done.json").exists()
            print(f"{'done   ' if done else 'pending'} {point.name}  (draft {point.draft_name})")
        print(f"{len(points)} points, {len({p.draft_name for p in points})} stage-1 drafts")
        return 0
    from pipelines.sweep.runner import run_sweep

    report = run_sweep(recipe)
    print(format_report(report))
    return 0 if report.ok else 1


def format_report(report: Any) -> str:
    results = report.results
    # The full table is in results.csv; print what compares points.
    wanted = ["point", "status", *report.grid_keys, report.metric, "acc_mean", "recall_mean", "loss", "head_loss",
              "acceptance_length", "point_wall_s"]
    shown = [c for c in dict.fromkeys(wanted) if c in results.columns]
    lines = [
        f"sweep: {len(results)} points: {len(report.ran)} ran, {len(report.skipped)} already finished, "
        f"{len(report.failed)} failed",
        results[shown].to_string(index=False, max_colwidth=48, float_format=lambda v: f"{v:.4g}"),
    ]
    for name, error in report.failed.items():
        lines.append(f"failed {name}: {error}")
    lines += [f"{name}: {path}" for name, path in report.files.items()]
    return "\n".join(lines)


