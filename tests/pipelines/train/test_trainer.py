"""The training loop on the reference target's real store: learning, exact resume, DDP, stage 2.

One short stage-1 run (session fixture) serves several tests: its loss must fall and its
per-depth accuracy rise; an interrupted-and-resumed copy must log the very same numbers; its final
checkpoint is the frozen draft the candidate-head test starts from.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from pipelines.train import TrainRecipe, run_training
from tests.support.paths import REFERENCE_TARGET, REPO_ROOT

pytestmark = pytest.mark.slow

STAGE1_STEPS = 36


def small_recipe(store: str, output_dir: Path, **overrides: Any) -> TrainRecipe:
    """The reference recipe shrunk for a CPU test: 2 x 256-token rows, a narrower MLP, a 1k vocab.

    The store has 27 samples (~13 steps per epoch), so STAGE1_STEPS is close to three epochs."""
    data: dict[str, Any] = {
        "store": store,
        "target": str(REFERENCE_TARGET),
        "output_dir": str(output_dir),
        "max_steps": STAGE1_STEPS,
        "draft": {"intermediate_size": 512, "vocab": {"draft_vocab_size": 1024}},
        "loader": {"token_budget": 256, "rows_per_batch": 2, "shuffle_window": 32, "read_threads": 2},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 4},
        "log_every": 1,
        "device": "cpu",
        "seed": 0,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return TrainRecipe.model_validate(data)


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def stage1(reference_store: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    output_dir = tmp_path_factory.mktemp("stage1")
    summary = run_training(small_recipe(reference_store, output_dir))
    return output_dir, summary


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_loss_falls_and_accuracy_rises(stage1: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    output_dir, summary = stage1
    metrics = read_metrics(output_dir)
    assert [m["step"] for m in metrics] == list(range(1, STAGE1_STEPS + 1))
    # Steps are single batches of varied difficulty: compare the first and last 10-step windows.
    first, last = metrics[:10], metrics[-10:]
    assert mean([m["loss"] for m in last]) < 0.9 * mean([m["loss"] for m in first])
    for depth in range(7):
        assert mean([m["acc"][depth] for m in last]) > mean([m["acc"][depth] for m in first]) + 0.01, depth
    assert mean([m["acc"][0] for m in last]) > mean([m["acc"][0] for m in first]) + 0.04
    assert summary["steps"] == STAGE1_STEPS and not summary["interrupted"]
    assert 0.0 <= summary["data_wait_frac"] < 1.0 and summary["tokens_per_s"] > 0
    assert summary["compile"] == "off"  # compile: auto, resolved for the CPU
    assert summary["teacher"] == "final_hidden"  # teacher: auto, resolved against the store
    final = Path(summary["checkpoint"])
    assert final == output_dir / "checkpoints" / "final"
    assert (final / "draft" / "model.safetensors").is_file() and (final / "optimizer.pt").is_file()
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["step"] == STAGE1_STEPS and state["loader"]["epoch"] >= 1
    vocab = json.loads((output_dir / "draft_vocab.json").read_text())
    assert vocab["draft_vocab_size"] == 1024


def test_stop_and_resume_reproduces_the_uninterrupted_run(reference_store: str, tmp_path: Path) -> None:
    # A cheaper shape than stage 1 (3-step unroll, one row per step): exactness does not need depth.
    def recipe(output_dir: Path) -> TrainRecipe:
        return small_recipe(reference_store, output_dir, max_steps=10, ttt_length=3, checkpoint_every=4,
                            loader={"rows_per_batch": 1})

    uninterrupted = run_training(recipe(tmp_path / "reference"))
    stopped = run_training(recipe(tmp_path / "run"), stop_at_step=6)  # between two periodic checkpoints
    assert stopped["interrupted"] and stopped["steps"] == 6
    assert Path(stopped["checkpoint"]).name == "step_000006"
    resumed = run_training(recipe(tmp_path / "run"))
    assert resumed["steps"] == 10 and not resumed["interrupted"] and uninterrupted["steps"] == 10
    expected, got = read_metrics(tmp_path / "reference"), read_metrics(tmp_path / "run")
    keys = ("step", "epoch", "lr", "loss", "acc", "positions", "tokens", "grad_norm")
    assert [{k: m[k] for k in keys} for m in got] == [{k: m[k] for k in keys} for m in expected]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ddp_worker(rank: int, world_size: int, port: int, recipe_json: str, result_dir: str) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    import torch

    torch.set_num_threads(1)
    summary = run_training(TrainRecipe.model_validate_json(recipe_json))
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(summary))


def test_ddp_two_gloo_processes_take_equal_steps(reference_store: str, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from hsstore.loader import StreamingLoader

    # No max_steps: one epoch, whose length per rank the loader sets. Unequal counts would hang the
    # per-step all-reduce; equal ones finish together.
    recipe = small_recipe(
        reference_store, tmp_path / "ddp", max_steps=None, schedule={"epochs": 1}, loader={"rows_per_batch": 2}
    )
    mp.spawn(
        _ddp_worker, args=(2, _free_port(), recipe.model_dump_json(), str(tmp_path)), nprocs=2, join=True
    )
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    per_rank = StreamingLoader(reference_store, ["aux_hidden_states"], token_budget=256, rows_per_batch=2,
                               shuffle_window=32, rank=1, world_size=2).num_batches(0)
    assert per_rank > 0
    assert [s["steps"] for s in summaries] == [per_rank, per_rank]
    assert summaries[0]["world_size"] == 2
    metrics = read_metrics(tmp_path / "ddp")  # rank 0 writes, numbers reduced over both ranks
    assert len(metrics) == per_rank
    assert summaries[0]["tokens"] == summaries[1]["tokens"] == sum(m["tokens"] for m in metrics)
    assert (tmp_path / "ddp" / "checkpoints" / "final" / "draft" / "config.json").is_file()


def test_candidate_head_recall_and_kl(stage1: tuple[Path, dict[str, Any]], reference_store: str, tmp_path: Path) -> None:
    """A rank-4 head (1024-id vocabulary, H=384): recall@8 rises from its SVD start to >= 0.95."""
    _, summary = stage1
    recipe = small_recipe(
        reference_store, tmp_path / "head", max_steps=16, model="eagle4", stage="candidate_head",
        candidate_head={"draft_checkpoint": summary["checkpoint"], "rank": 4, "num_candidates": 8},
        optimizer={"lr": 5e-3}, schedule={"warmup_steps": 2},
    )
    result = run_training(recipe)
    metrics = read_metrics(tmp_path / "head")
    first, last = metrics[:3], metrics[-3:]
    assert mean([mean(m["kl"]) for m in last]) < 0.6 * mean([mean(m["kl"]) for m in first])
    # Training, not the SVD start, brings recall up (0.94 at step 1 when written, 0.99 at the end).
    assert mean(metrics[0]["recall"]) < mean([mean(m["recall"]) for m in last]) - 0.02
    for depth in range(7):  # recall@8 at every depth, over the last three steps
        assert mean([m["recall"][depth] for m in last]) >= 0.95, (depth, last)
    assert result["final_acc"] == metrics[-1]["recall"]
    from pipelines.models.checkpoint import load_draft

    draft = load_draft(result["checkpoint"])
    assert draft.config.candidate_rank == 4 and draft.config.num_candidates == 8
    assert draft.candidate_head is not None


def test_cli_runs_the_shipped_recipe_and_resumes(
    reference_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipelines.cli import main

    recipe = REPO_ROOT / "recipes" / "reference" / "train-eagle3.yaml"
    common = [
        "train", str(recipe), "--set", f"store={reference_store}", "--set", f"target={REFERENCE_TARGET}",
        "--set", f"output_dir={tmp_path / 'cli'}", "--set", "device=cpu", "--set", "loader.token_budget=256",
        "--set", "draft.intermediate_size=256", "--set", "draft.vocab.draft_vocab_size=512", "--set", "log_every=1",
    ]
    assert main([*common, "--set", "max_steps=2"]) == 0
    printed = capsys.readouterr().out
    final = tmp_path / "cli" / "checkpoints" / "final"
    assert f"final checkpoint: {final}" in printed
    # Rerun with a longer schedule: it resumes from final (step 2) and takes one more step, this
    # time through a spawned DataLoader worker (the loader state is the same either way).
    assert main([*common, "--set", "max_steps=3", "--set", "loader.num_workers=1"]) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "cli")] == [1, 2, 3]
    assert json.loads((final / "trainer_state.json").read_text())["step"] == 3
    # A contradiction on the command line is refused with the dotted key, before any work.
    assert main([*common, "--set", "model=eagle4", "--set", "draft.sliding_window=3"]) == 1
    assert "draft.sliding_window=3 is smaller than ttt_length=7" in capsys.readouterr().err


def test_init_from_a_pretrained_draft(stage1: tuple[Path, dict[str, Any]], reference_store: str, tmp_path: Path) -> None:
    """``init_from`` starts from the stage-1 weights: its first step scores like stage 1's last."""
    stage1_dir, summary = stage1
    recipe = small_recipe(reference_store, tmp_path / "init", max_steps=1, init_from=str(Path(summary["checkpoint"]) / "draft"))
    run_training(recipe)
    first = read_metrics(tmp_path / "init")[0]
    stage1_metrics = read_metrics(stage1_dir)
    assert first["loss"] < stage1_metrics[0]["loss"] - 2.0
    assert first["acc"][0] > stage1_metrics[0]["acc"][0] + 0.05


def test_loss_normalization_tokens(reference_store: str, tmp_path: Path) -> None:
    """``loss_normalization: tokens`` divides every depth's sum by the step's real tokens: from the
    same initial draft and first batch, step 1's loss is the scored-normalised one rescaled depth
    by depth (scored positions / real tokens), so it is smaller wherever positions go unscored."""
    import torch

    from pipelines.train.distributed import Distributed
    from pipelines.train.objective import ObjectiveOutput, loss_denominators, objective_loss

    counts = torch.tensor([6.0, 5.0, 4.0], dtype=torch.float64)
    single = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert torch.equal(loss_denominators("scored", counts, 10, single), counts)
    assert loss_denominators("tokens", counts, 10, single).tolist() == [10.0, 10.0, 10.0]
    out = ObjectiveOutput([torch.tensor(6.0), torch.tensor(5.0), torch.tensor(4.0)], list(counts), [])
    assert float(objective_loss(out, loss_denominators("scored", counts, 10, single), 0.5, False)) == 1.75
    assert float(objective_loss(out, loss_denominators("tokens", counts, 10, single), 0.5, False)) == pytest.approx(0.6 + 0.25 + 0.1)

    first = {}
    for mode in ("scored", "tokens"):
        run_training(small_recipe(reference_store, tmp_path / mode, max_steps=1, loss_normalization=mode))
        first[mode] = read_metrics(tmp_path / mode)[0]
    scored, tokens = first["scored"], first["tokens"]
    assert scored["positions"] == tokens["positions"] and scored["tokens"] == tokens["tokens"]
    assert tokens["loss"] < scored["loss"]
    assert max(scored["positions"]) <= scored["tokens"]


def test_a_store_of_aux_states_alone_trains_with_teacher_tokens(records_path: Path, tmp_path: Path) -> None:
    """``capture.target_distribution: none`` extracts the aux states alone (a real extraction of the
    reference target); such a store trains with ``teacher: tokens``, and ``auto`` refuses it by name."""
    import hsstore
    from hsstore.errors import LineageMismatchError
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import RecipeError, build_recipe

    base = {
        "target": str(REFERENCE_TARGET), "data": [str(records_path)], "store": str(tmp_path / "aux-only"),
        "limit": 12, "executor": "local", "model": {"dtype": "float32", "device": "cpu"},
        "capture": {"aux_layer_ids": [2, 4, 5], "target_distribution": "none", "final_hidden_state": False},
        "batching": {"max_length": 256, "too_long": "truncate", "token_budget": 2048},
    }
    with pytest.raises(RecipeError, match="target_distribution=none stores no distribution"):
        build_recipe(ExtractRecipe, {**base, "capture": {"target_distribution": "none"}})
    run_extraction(build_recipe(ExtractRecipe, base))
    store = hsstore.open_store(base["store"])
    assert set(store.features) == {"aux_hidden_states"} and store.lineage.target_distribution == "none"
    with pytest.raises(LineageMismatchError, match="holds no target distribution.*teacher: tokens"):
        run_training(small_recipe(base["store"], tmp_path / "auto", max_steps=1))
    summary = run_training(small_recipe(base["store"], tmp_path / "tokens", max_steps=2, teacher="tokens"))
    assert summary["teacher"] == "tokens" and summary["steps"] == 2
    assert all(n > 0 for n in read_metrics(tmp_path / "tokens")[-1]["positions"])
