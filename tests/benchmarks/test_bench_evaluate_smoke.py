"""``python -m benchmarks.bench_evaluate`` at a tiny size: a random draft for the reference target
decodes a few short prompts in every setting asked for, and the table and JSON come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def test_benchmark_script_runs_at_a_tiny_size(
    tmp_path: Path, reference_target: Path, shared_data: Path, capsys: pytest.CaptureFixture
) -> None:
    from benchmarks import bench_evaluate
    from pipelines.evaluate.target import TargetModel
    from pipelines.models.checkpoint import save_draft
    from tests.pipelines.evaluate.helpers import random_draft

    target = TargetModel.from_pretrained(reference_target, [2, 4, 5], torch.float32, "cpu", "sdpa")
    save_draft(random_draft(target, seed=9), tmp_path / "draft" / "draft")
    prompts = tmp_path / "prompts.jsonl"
    with open(shared_data / "eval_prompts.jsonl", encoding="utf-8") as src, open(prompts, "w") as dst:
        for line in src:  # real chats cut short: fast prefills
            record = json.loads(line)
            record["messages"] = [{**m, "content": m["content"][:240]} for m in record["messages"]]
            dst.write(json.dumps(record) + "\n")
    out = tmp_path / "bench.json"
    argv = ["--draft", str(tmp_path / "draft"), "--prompts", str(prompts), "--device", "cpu", "--limit", "1",
            "--max-new-tokens", "4", "--chains", "2", "--trees", "2/2/3", "--out", str(out)]
    assert bench_evaluate.main(argv) == 0
    table = capsys.readouterr().out
    assert "| chain-2-greedy |" in table and "| tree-2-2-3-t1 |" in table
    results = json.loads(out.read_text())
    assert len(results["settings"]) == 4 and results["benchmark"]["cpu_threads"] >= 1
