"""Running a sweep: one draft per point, in sequence or as Ray tasks, resumable by done markers.

Layout under ``output_dir``::

    sweep.yaml                      # the resolved sweep recipe
    drafts/<draft-name>/            # a stage-1 training run (TrainRecipe.output_dir), shared by the
      done.json                     #   points that differ only in candidate_head.* keys
    points/<point-name>/
      head/                         # stage 2 (candidate head), when the sweep has one
      eval/                         # evaluation outputs, when the sweep evaluates
      done.json                     # the point's results row and the recipes it ran: the marker
    results.parquet, results.csv    # one row per point (failed ones too, with their error)
    plots/<metric>_vs_<key>.png

A point is finished exactly when its ``done.json`` exists (written atomically, last). A rerun skips
finished points and shared drafts; a point killed mid-training resumes from its newest trainer
checkpoint (the trainer's own resume). ``done.json`` pins the recipes a point ran: if the sweep
recipe has changed since, the rerun refuses rather than mixing results of two different sweeps.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsstore.errors import HsstoreError, RecipeError
from pipelines.recipe import dump_recipe
from pipelines.sweep.recipe import SweepPoint, SweepRecipe, default_metric, expand, flatten

if TYPE_CHECKING:
    import pandas as pd

    from pipelines.train.config import TrainRecipe

logger = logging.getLogger(__name__)
DONE_NAME = "done.json"


class SweepPointError(HsstoreError, RuntimeError):
    """A point's training or evaluation failed (its row says why; a rerun retries it)."""


@dataclass
class SweepReport:
    """What :func:`run_sweep` did: the results table and which points ran, were skipped or failed."""

    results: pd.DataFrame
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    metric: str = ""
    grid_keys: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


def run_sweep(recipe: SweepRecipe) -> SweepReport:
    """Train (and optionally evaluate) every point not finished yet; write results and plots."""
    points = expand(recipe)  # validates every recipe before anything runs
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, out / "sweep.yaml")
    done = {p.name for p in points if _check_marker(out / "points" / p.name, p.recipes_json)}
    for point in points:
        _check_marker(out / "drafts" / point.draft_name, {"draft": point.recipes_json["draft"]})
    todo = [p for p in points if p.name not in done]
    logger.info("sweep %s: %d points, %d finished already, %d to run (%s)", out, len(points), len(done), len(todo), recipe.executor)
    failed = _run_ray(recipe, todo) if recipe.executor == "ray" else _run_sequential(recipe, todo)
    report = SweepReport(
        results=_results_frame(out, points, failed),
        ran=[p.name for p in todo if p.name not in failed],
        skipped=sorted(done, key=[p.name for p in points].index),
        failed=failed,
        grid_keys=list(recipe.grid),
    )
    report.metric = resolve_metric(report.results, default_metric(recipe))
    report.files = write_results(report.results, out, list(recipe.grid), report.metric)
    return report


# -- one point ------------------------------------------------------------------------------------


def run_point(point: SweepPoint, out: Path) -> dict[str, Any]:
    """Train the point's draft (unless its shared draft is done), its candidate head, evaluate; write
    ``done.json`` last. Returns the results row."""
    started = time.time()
    draft = ensure_draft(point, out)
    row: dict[str, Any] = {"point": point.name, "status": "done", **point.overrides, "draft": point.draft_name}
    row.update(_train_columns(draft, "acc", ""))
    if point.head_recipe is not None:
        head = _train(point.head_recipe, point.name)
        row.update(_train_columns(head, "recall", "head_"))
        if head.get("final_kl"):
            row["head_kl_mean"] = sum(head["final_kl"]) / len(head["final_kl"])
    if point.evaluate_recipe is not None:
        row.update(_evaluate(point))
    row["point_wall_s"] = round(time.time() - started, 2)
    _write_json(out / "points" / point.name / DONE_NAME, {"row": row, "recipes": point.recipes_json, "finished_at": time.time()})
    return row


def ensure_draft(point: SweepPoint, out: Path) -> dict[str, Any]:
    """The stage-1 training summary, training it now unless a finished marker exists."""
    directory = out / "drafts" / point.draft_name
    marker = directory / DONE_NAME
    if marker.exists():
        return json.loads(marker.read_text())["summary"]
    summary = _train(point.draft_recipe, point.name)
    _write_json(marker, {"summary": summary, "recipes": {"draft": point.recipes_json["draft"]}, "finished_at": time.time()})
    return summary


def _train(recipe: TrainRecipe, point: str) -> dict[str, Any]:
    from pipelines.train import run_training

    logger.info("sweep point %s: training %s -> %s", point, recipe.stage, recipe.output_dir)
    summary = run_training(recipe)
    if summary.get("interrupted"):
        # The trainer checkpointed on SIGTERM/SIGINT; stop the sweep, a rerun resumes this point.
        raise KeyboardInterrupt(f"sweep point {point}: training interrupted at step {summary['steps']}; rerun to resume")
    return summary


def _evaluate(point: SweepPoint) -> dict[str, Any]:
    from pipelines.evaluate import EvaluateRecipe, run_evaluation
    from pipelines.recipe import build_recipe

    assert point.evaluate_recipe is not None
    recipe = build_recipe(EvaluateRecipe, point.evaluate_recipe, source=f"evaluate of sweep point {point.name}")
    return evaluation_columns(run_evaluation(recipe))


def evaluation_columns(results: dict[str, Any]) -> dict[str, Any]:
    """The numbers of ``run_evaluation``'s dict that compare points: per decoding setting the
    acceptance length, tokens/s, speedup and greedy agreement (suffixed ``.<setting>`` when the
    evaluation measures several settings), and the offline proxy's scalars."""
    settings = results.get("settings") or []
    columns: dict[str, Any] = {}
    for setting in settings:
        suffix = "" if len(settings) == 1 else f".{setting['name']}"
        for key in ("acceptance_length", "tokens_per_second", "speedup"):
            if setting.get(key) is not None:
                columns[key + suffix] = setting[key]
        agreement = setting.get("greedy_agreement")
        if agreement:
            columns["greedy_identical" + suffix] = agreement["identical"] / max(1, agreement["num_prompts"])
    proxy = results.get("offline_proxy")
    if isinstance(proxy, dict):
        columns.update({f"proxy.{k}": v for k, v in flatten(proxy).items() if isinstance(v, int | float)})
    return columns


def _train_columns(summary: dict[str, Any], what: str, prefix: str) -> dict[str, Any]:
    """A trainer summary as flat columns: per-depth accuracy (or recall) ``acc_0..``, their mean, loss
    and throughput."""
    columns: dict[str, Any] = {
        f"{prefix}loss": summary.get("final_loss"),
        f"{prefix}steps": summary.get("steps"),
        f"{prefix}tokens": summary.get("tokens"),
        f"{prefix}tokens_per_s": summary.get("tokens_per_s"),
        f"{prefix}wall_s": summary.get("wall_s"),
    }
    per_depth = summary.get("final_acc") or []
    for depth, value in enumerate(per_depth):
        columns[f"{what}_{depth}"] = value
    if per_depth:
        columns[f"{what}_mean"] = sum(per_depth) / len(per_depth)
    return columns


# -- executors ------------------------------------------------------------------------------------


def _run_sequential(recipe: SweepRecipe, todo: list[SweepPoint]) -> dict[str, str]:
    out = Path(recipe.output_dir)
    failed: dict[str, str] = {}
    failed_drafts: dict[str, str] = {}  # a shared draft that failed is not retried by its other points
    for i, point in enumerate(todo, 1):
        logger.info("sweep point %d/%d: %s", i, len(todo), point.name)
        if point.draft_name in failed_drafts:
            failed[point.name] = f"its stage-1 draft {point.draft_name} failed: {failed_drafts[point.draft_name]}"
            continue
        try:
            run_point(point, out)
        except Exception as err:
            if recipe.stop_on_error:
                raise SweepPointError(f"sweep point {point.name} failed: {err}") from err
            logger.exception("sweep point %s failed; continuing (a rerun retries it)", point.name)
            failed[point.name] = f"{type(err).__name__}: {err}"
            if not (out / "drafts" / point.draft_name / DONE_NAME).exists():
                failed_drafts[point.draft_name] = failed[point.name]
    return failed


def _ray_draft(point: SweepPoint, out: str, cwd: str, num_threads: int) -> dict[str, Any]:
    _in_worker(cwd, num_threads)
    return ensure_draft(point, Path(out))


def _ray_point(point: SweepPoint, out: str, cwd: str, num_threads: int, _draft: dict[str, Any]) -> dict[str, Any]:
    _in_worker(cwd, num_threads)
    return run_point(point, Path(out))


def _in_worker(cwd: str, num_threads: int) -> None:
    """Relative recipe paths mean the driver's working directory; torch gets the task's CPU share."""
    import torch

    if os.path.isdir(cwd):
        os.chdir(cwd)
    torch.set_num_threads(max(1, num_threads))


def _run_ray(recipe: SweepRecipe, todo: list[SweepPoint]) -> dict[str, str]:
    """Stage-1 drafts as tasks (each distinct one once), each point as a task waiting on its draft.

    ``output_dir`` must be on storage every node sees (local disk for a one-machine Ray)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=recipe.ray.address, ignore_reinit_error=True, log_to_driver=True)
    settings = recipe.ray
    gpus = settings.num_gpus_per_point
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    options = {"num_cpus": settings.num_cpus_per_point, "num_gpus": gpus, "max_retries": settings.max_retries}
    draft_task = ray.remote(**options)(_ray_draft)
    point_task = ray.remote(**options)(_ray_point)
    out, cwd, threads = str(Path(recipe.output_dir).resolve()), os.getcwd(), int(settings.num_cpus_per_point)
    draft_refs: dict[str, Any] = {}
    for point in todo:
        if point.draft_name not in draft_refs:
            draft_refs[point.draft_name] = draft_task.remote(point, out, cwd, threads)
    refs = {point_task.remote(p, out, cwd, threads, draft_refs[p.draft_name]): p.name for p in todo}
    failed: dict[str, str] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        name = refs[ready[0]]
        try:
            ray.get(ready[0])
            logger.info("sweep point %s: done (%d left)", name, len(pending))
        except Exception as err:  # RayTaskError wraps the point's own exception
            if recipe.stop_on_error:
                for ref in pending:
                    ray.cancel(ref)
                raise SweepPointError(f"sweep point {name} failed: {err}") from err
            logger.error("sweep point %s failed: %s", name, err)
            failed[name] = f"{type(err).__name__}: {err}"
    return failed


# -- markers and results --------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Temp file then rename: a marker is either absent or complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(temp, path)


def _check_marker(directory: Path, recipes: dict[str, Any]) -> bool:
    """True when ``directory`` holds a done marker for exactly these recipes; refuses a marker left by
    a different recipe (the sweep changed under the same output_dir)."""
    marker = directory / DONE_NAME
    if not marker.exists():
        return False
    pinned = json.loads(marker.read_text()).get("recipes", {})
    diffs = _diff(flatten({k: pinned.get(k) for k in recipes}), flatten(recipes))
    if diffs:
        key, old, new = diffs[0]
        raise RecipeError(
            f"{marker}: this point was finished with another recipe ({key}: {old!r} then, {new!r} now); "
            "use a new output_dir, or delete the point's directory to retrain it"
        )
    return True


def _diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _results_frame(out: Path, points: list[SweepPoint], failed: dict[str, str]) -> pd.DataFrame:
    import pandas as pd

    rows = []
    for point in points:
        marker = out / "points" / point.name / DONE_NAME
        if marker.exists():
            rows.append(json.loads(marker.read_text())["row"])
        else:
            status = "failed" if point.name in failed else "pending"
            rows.append({"point": point.name, "status": status, **point.overrides, "error": failed.get(point.name)})
    frame = pd.DataFrame(rows)
    return frame[_column_order(list(frame.columns), list(points[0].overrides) if points else [])]


def _column_order(columns: list[str], keys: list[str]) -> list[str]:
    """point, status, the swept keys, then per-depth families (acc_0, acc_1, ...) kept together and in
    depth order, then the rest as first seen."""
    front = [c for c in ("point", "status", *keys) if c in columns]
    rest = [c for c in columns if c not in front]

    def sort_key(column: str) -> tuple[int, str, int]:
        family, _, depth = column.rpartition("_")
        if depth.isdigit():
            first = min(i for i, c in enumerate(rest) if c.rpartition("_")[0] == family)
            return (first, family, int(depth))
        return (rest.index(column), column, -1)

    return front + sorted(rest, key=sort_key)


def resolve_metric(results: pd.DataFrame, metric: str) -> str:
    """``metric`` itself, or its first per-setting column (``acceptance_length.<setting>``) when the
    evaluation measured several decoding settings."""
    if metric in results:
        return metric
    return next((c for c in results.columns if c.startswith(metric + ".")), metric)


def write_results(results: pd.DataFrame, out: Path, keys: list[str], metric: str) -> dict[str, Path]:
    """``results.parquet``, ``results.csv`` and one PNG per swept key of ``metric`` against it."""
    files = {"parquet": out / "results.parquet", "csv": out / "results.csv"}
    # Parquet wants one type per column: grid values may mix (e.g. null and 16), so store them as text
    # there only when they do; the CSV keeps them as written.
    table = results.copy()
    for key in keys:
        if key in table and table[key].map(type).nunique() > 1:
            table[key] = table[key].astype(str)
    table.to_parquet(files["parquet"], index=False)
    results.to_csv(files["csv"], index=False)
    from pipelines.sweep.plots import plot_metric

    metric = resolve_metric(results, metric)
    if metric in results and results[metric].notna().any():
        for key in keys:
            path = out / "plots" / f"{metric}_vs_{key}.png"
            plot_metric(results, key, metric, path)
            files[f"plot:{key}"] = path
    else:
        logger.warning("sweep %s: no values of metric %r to plot", out, metric)
    return files
