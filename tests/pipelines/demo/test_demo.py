"""The README's main command, shortened: extract -> train -> export -> evaluate on the reference target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT


@pytest.mark.slow
def test_demo_end_to_end_reaches_acceptance_above_one(tmp_path):
    workdir = tmp_path / "demo"
    # 10 steps (training was 77 of the test's ~100 s at 60): measured acceptance (tree) 1.29 at 10
    # steps as at 20, 1.02 at 4 and 1.00 on both settings after 1 step, so `best > 1.0` still fails
    # for an untrained draft.
    command = [
        sys.executable, "-m", "pipelines.cli", "demo",
        "--workdir", str(workdir),
        "--records", "40", "--max-length", "384",
        "--train-steps", "10", "--prompts", "3", "--max-new-tokens", "32",
        "--executor", "local",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hsstore demo (cpu)" in out.stdout and "acceptance length, chain-5-greedy" in out.stdout
    results = json.loads((workdir / "demo.json").read_text())
    assert results["samples"] > 0 and results["tokens"] > 0 and results["bytes_per_token"] > 0
    for setting in results["settings"]:
        # Greedy speculative decoding reproduced target-only greedy decoding on every prompt.
        agreement = setting["greedy_agreement"]
        assert agreement["identical"] == agreement["num_prompts"] == 3 and agreement["diverged"] == []
    best = max(s["acceptance_length"] for s in results["settings"])
    assert best > 1.0, results["settings"]
    for path in results["artifacts"].values():
        assert Path(path).exists(), path
    # The printed acceptance length is the one in the results.
    assert f"{results['settings'][0]['acceptance_length']:.2f}" in out.stdout


REFERENCE_DRAFT = REPO_ROOT / "examples" / "reference-draft"


@pytest.mark.slow
def test_demo_draft_evaluates_the_shipped_reference_draft(tmp_path, capsys):
    """`hsstore demo --draft examples/reference-draft`: no extraction or training, and the shipped
    draft (trained on the target's own answers) is accepted well above an untrained draft's ~1.0.
    The CLI's main in this process (the end-to-end test above runs the command as a process)."""
    from pipelines.cli import main

    workdir = tmp_path / "demo"
    argv = ["demo", "--draft", str(REFERENCE_DRAFT), "--workdir", str(workdir), "--prompts", "3", "--max-new-tokens", "48"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    results = json.loads((workdir / "demo.json").read_text())
    assert not (workdir / "store").exists() and "samples" not in results  # nothing extracted or trained
    by_name = {s["name"]: s for s in results["settings"]}
    for setting in by_name.values():
        agreement = setting["greedy_agreement"]
        assert agreement["identical"] == agreement["num_prompts"] == 3
    # An untrained draft is accepted ~1.0; on these 3 prompts x 48 tokens (CPU, float32) the shipped
    # draft measured chain 2.00, tree 2.86 (2.95 / 3.73 over the 50 prompts x 128 tokens of
    # reference-draft.json; the draft shipped before it: chain 1.53).
    chain, tree = by_name["chain-5-greedy"]["acceptance_length"], by_name["tree-8-5-31-greedy"]["acceptance_length"]
    assert chain > 1.35 and tree > chain, results["settings"]
    assert f"{results['settings'][0]['acceptance_length']:.2f}" in out


def test_demo_draft_names_a_folder_without_a_draft(tmp_path):
    from pipelines.demo import run_draft_demo

    with pytest.raises(FileNotFoundError, match=r"--draft .*nothing-here: no config.json"):
        run_draft_demo(tmp_path / "nothing-here", workdir=tmp_path / "demo")
