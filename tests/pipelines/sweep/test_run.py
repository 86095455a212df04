"""Sweeps that really train: a killed sweep resumes with only the missing points, changed recipes
are refused, failures are recorded and retried, the Ray executor gives the same table."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from hsstore.errors import RecipeError
from pipelines.cli import main as cli_main
from pipelines.sweep import expand, load_sweep_recipe, run_sweep
from tests.pipelines.sweep.helpers import tiny_train_base
from tests.support.paths import REPO_ROOT as REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_sweep(path: Path, store: str, **fields) -> Path:
    data = {"base": tiny_train_base(store), "output_dir": str(path.parent / "out"), **fields}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def marker(out: Path, name: str) -> Path:
    return out / "points" / name / "done.json"


@pytest.fixture
def no_target_stack(monkeypatch):
    """Training must never load the target's transformer stack (only embed/norm/lm_head tensors)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError(f"the target's model was loaded during a sweep: {args}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.slow
def test_a_killed_sweep_reruns_only_the_missing_points(tmp_path, reference_store, no_target_stack):
    recipe_path = write_sweep(tmp_path / "sweep.yaml", reference_store, grid={"ttt_length": [2, 3, 4]})
    recipe = load_sweep_recipe(recipe_path)
    out, names = Path(recipe.output_dir), [p.name for p in expand(recipe)]

    # A real interruption: the sweep runs in its own process and is SIGKILLed once a point is done.
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "sweep", str(recipe_path)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not marker(out, names[0]).exists():
        assert proc.poll() is None, f"the sweep ended before it was killed: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no point finished within 240 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = [name for name in names if marker(out, name).exists()]
    assert finished and len(finished) < len(names), finished
    before = {name: marker(out, name).read_text() for name in finished}
    assert not (out / "results.parquet").exists()  # killed before the end

    report = run_sweep(load_sweep_recipe(recipe_path))
    assert report.skipped == finished
    assert report.ran == [n for n in names if n not in finished] and report.ok
    for name in finished:  # untouched: not retrained
        assert marker(out, name).read_text() == before[name]
    results = pd.read_parquet(out / "results.parquet")
    assert list(results["point"]) == names and (results["status"] == "done").all()
    assert list(results["ttt_length"]) == [2, 3, 4]
    assert results["acc_0"].between(0, 1).all() and results["loss"].gt(0).all()
    assert results["acc_2"].isna().tolist() == [True, False, False]  # depth 2 exists from ttt_length 3
    assert len(pd.read_csv(out / "results.csv")) == 3
    assert (out / "plots" / "acc_0_vs_ttt_length.png").read_bytes()[:8] == PNG_MAGIC

    # A third run has nothing left to do; a changed recipe under the same output_dir is refused.
    again = run_sweep(load_sweep_recipe(recipe_path))
    assert again.ran == [] and again.skipped == names
    with pytest.raises(RecipeError, match=r"done.json: this point was finished with another recipe \(draft.max_steps: 1 then, 2 now\)"):
        run_sweep(load_sweep_recipe(recipe_path, ["overrides.max_steps=2"]))


@pytest.mark.slow
def test_stage2_points_share_a_draft_and_the_cli_grid_extends_it(tmp_path, reference_store, no_target_stack, capsys):
    recipe_path = write_sweep(tmp_path / "sweep.yaml", reference_store, stages=["draft", "candidate_head"],
                              grid={"candidate_head.rank": [4, 8]})
    args = ["sweep", str(recipe_path), "--grid", "candidate_head.num_candidates=4"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "2 ran, 0 already finished, 0 failed" in printed and "recall_0" in printed
    out = tmp_path / "out"
    assert len(list((out / "drafts").iterdir())) == 1  # both points froze the same stage-1 draft
    results = pd.read_parquet(out / "results.parquet")
    assert list(results["candidate_head.rank"]) == [4, 8]
    assert results["recall_0"].between(0, 1).all() and results["head_kl_mean"].ge(0).all()
    assert results["draft"].nunique() == 1
    for key in ("candidate_head.rank", "candidate_head.num_candidates"):
        assert (out / "plots" / f"recall_0_vs_{key}.png").exists()
    assert cli_main([*args, "--dry-run"]) == 0
    assert capsys.readouterr().out.count("done    ") == 2


def test_failed_points_are_recorded_and_retried(tmp_path, reference_store):
    base = tiny_train_base(str(tmp_path / "no-store-here"))
    recipe_path = tmp_path / "sweep.yaml"
    recipe_path.write_text(yaml.safe_dump({"base": base, "grid": {"ttt_length": [2, 3]}, "output_dir": str(tmp_path / "out")}))
    assert cli_main(["sweep", str(recipe_path)]) == 1
    results = pd.read_csv(tmp_path / "out" / "results.csv")
    assert list(results["status"]) == ["failed", "failed"]
    assert results["error"].str.contains("no committed store here").all()
    assert not list((tmp_path / "out").glob("points/*/done.json"))
    # Fix the store: the rerun retries the failed points.
    report = run_sweep(load_sweep_recipe(recipe_path, ["base.store=" + json.dumps(reference_store)]))
    assert report.ok and len(report.ran) == 2


@pytest.mark.slow
def test_ray_executor_trains_every_point(tmp_path, reference_store, ray_session):
    recipe_path = write_sweep(tmp_path / "sweep.yaml", reference_store, grid={"ttt_length": [2, 3]}, executor="ray",
                              ray={"num_cpus_per_point": 1})
    report = run_sweep(load_sweep_recipe(recipe_path))
    assert report.ok and len(report.ran) == 2
    results = report.results
    assert (results["status"] == "done").all() and results["acc_0"].between(0, 1).all()
    assert all((tmp_path / "out" / "drafts" / name / "done.json").exists() for name in results["draft"])


@pytest.mark.slow
def test_points_are_evaluated_by_really_decoding(tmp_path, reference_store):
    prompts = tmp_path / "prompts.jsonl"  # one short prompt: the CPU prefill stays cheap
    prompts.write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "Write a Python function that reverses a list."}]}) + "\n")
    evaluate = {
        "recipe": str(REPO / "recipes" / "reference" / "evaluate.yaml"),
        "overrides": {"prompts": str(prompts), "limit": 1,
                      "max_new_tokens": 8, "settings": [{"num_draft_tokens": 3}], "baseline": False,
                      "warmup_tokens": 0, "proxy": None, "device": "cpu"},
    }
    recipe_path = write_sweep(tmp_path / "sweep.yaml", reference_store, grid={"ttt_length": [2]}, evaluate=evaluate)
    report = run_sweep(load_sweep_recipe(recipe_path))
    assert report.ok and report.metric == "acceptance_length"
    row = report.results.iloc[0]
    assert 1.0 <= row["acceptance_length"] <= 4.0  # the bonus token, plus up to 3 accepted draft tokens
    results = json.loads((tmp_path / "out" / "points" / row["point"] / "eval" / "evaluation_results.json").read_text())
    assert results["acceptance_length"] == row["acceptance_length"]
    assert results["draft"].endswith(f"drafts/{row['draft']}/checkpoints/final")
    assert (tmp_path / "out" / "plots" / "acceptance_length_vs_ttt_length.png").exists()


def test_a_bad_evaluate_recipe_fails_before_training(tmp_path, reference_store):
    evaluate = {"recipe": str(REPO / "recipes" / "reference" / "evaluate.yaml"), "overrides": {"settings": []}}
    recipe_path = write_sweep(tmp_path / "sweep.yaml", reference_store, grid={"ttt_length": [2]}, evaluate=evaluate)
    with pytest.raises(RecipeError, match="(?s)the sweep's evaluate recipe.*settings"):
        run_sweep(load_sweep_recipe(recipe_path))
    assert not (tmp_path / "out").exists()
