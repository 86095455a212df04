"""The recipe, the prompts file, ``run_evaluation`` and ``hsstore evaluate`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hsstore.errors import RecipeError
from pipelines.cli import main as hsstore_main
from pipelines.evaluate import EvaluateRecipe, run_evaluation
from pipelines.evaluate.drafter import DraftMismatchError
from pipelines.evaluate.prompts import PromptError, load_prompts
from pipelines.evaluate.proxy import predicted_chain_length
from pipelines.evaluate.target import TargetModel
from pipelines.models.checkpoint import save_draft
from pipelines.recipe import build_recipe, load_recipe
from tests.pipelines.evaluate.helpers import random_draft
from tests.support.paths import REPO_ROOT


def recipe_dict(**overrides: object) -> dict:
    base = {
        "target": "t",
        "draft": "d",
        "prompts": "p.jsonl",
        "output_dir": "out",
        "settings": [{"num_draft_tokens": 3}],
    }
    return {**base, **overrides}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ([{"num_draft_tokens": 3, "draft_top_k": 2}], "not both"),
        (
            [{"draft_top_k": 8, "draft_depth": 5}],
            "all of draft_top_k, draft_depth and total_draft_tokens",
        ),
        ([{"num_draft_tokens": 3, "top_p": 0.9}], "top_p applies only when sampling"),
        (
            [{"num_draft_tokens": 3}, {"num_draft_tokens": 3}],
            r"share the label\(s\) \['chain-3-greedy'\]",
        ),
        ([], "settings: List should have at least 1 item"),
    ],
)
def test_recipe_refuses_bad_settings(settings: list, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        build_recipe(EvaluateRecipe, recipe_dict(settings=settings))


def test_shipped_recipes_load() -> None:
    for path in ["recipes/reference/evaluate.yaml", "recipes/qwen3/qwen3-8b-eagle3-evaluate.yaml"]:
        recipe = load_recipe(EvaluateRecipe, REPO_ROOT / path)
        assert recipe.settings
    reference = load_recipe(EvaluateRecipe, REPO_ROOT / "recipes/reference/evaluate.yaml")
    shapes = [(s.top_k, s.depth, s.num_nodes) for s in reference.settings]
    assert (1, 5, 5) in shapes and (8, 5, 31) in shapes


def test_prompts_chat_and_text_records(tmp_path: Path, reference_target: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reference_target))
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "def f(x):"}]
    path.write_text(
        json.dumps({"id": "a", "messages": chat})
        + "\n\n"
        + json.dumps({"conversations": [{"from": "human", "value": "hi"}]})
        + "\n"
        + json.dumps({"id": "c", "text": "import os\n"})
        + "\n"
    )
    prompts = load_prompts(str(path), tokenizer)
    assert [p.id for p in prompts] == ["a", f"{path}:3", "c"]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompts[0].input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(prompts[0].input_ids).endswith("<|im_start|>assistant\n")
    assert len(load_prompts(str(path), tokenizer, limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
            r":1: the chat ends with an assistant turn",
        ),
        ("{not json", r":1: not valid JSON"),
        ('{"id": "x"}', r":1: a prompt record needs 'messages' \(a chat\) or 'text'"),
    ],
)
def test_bad_prompt_records_are_named(
    tmp_path: Path, reference_target: Path, line: str, message: str
) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(PromptError, match=message):
        load_prompts(str(path), AutoTokenizer.from_pretrained(str(reference_target)))


def test_predicted_chain_length() -> None:
    assert predicted_chain_length([0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert predicted_chain_length([None], 4) == 1.0


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory: pytest.TempPathFactory, reference_sdpa: TargetModel) -> Path:
    directory = tmp_path_factory.mktemp("random-draft")
    save_draft(random_draft(reference_sdpa, seed=9), directory / "draft")
    return directory


@pytest.mark.slow
def test_run_evaluation_writes_results_and_reproduces_generate(
    tmp_path: Path,
    reference_target: Path,
    random_draft_dir: Path,
    short_prompts_file: Path,
    reference_sdpa: TargetModel,
) -> None:
    recipe = build_recipe(
        EvaluateRecipe,
        {
            "target": str(reference_target),
            "draft": str(random_draft_dir),
            "prompts": str(short_prompts_file),
            "output_dir": str(tmp_path / "eval"),
            "limit": 2,
            "max_new_tokens": 10,
            "save_outputs": True,
            "settings": [
                {"num_draft_tokens": 3},
                {"draft_top_k": 4, "draft_depth": 3, "total_draft_tokens": 8},
                {"num_draft_tokens": 2, "temperature": 1.0, "top_p": 0.9},
            ],
            "device": "cpu",
            "warmup_tokens": 2,
        },
    )
    results = run_evaluation(recipe)
    on_disk = json.loads((tmp_path / "eval" / "evaluation_results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    text = (tmp_path / "eval" / "evaluation_results.txt").read_text()
    assert "tree-4-3-8-greedy" in text and "identical 2/2" in text
    assert set(results["acceptance_length"]) == {
        "chain-3-greedy",
        "tree-4-3-8-greedy",
        "chain-2-t1-p0.9",
    }
    assert results["num_prompts"] == 2 and results["batch_size"] == 1
    prompts = [json.loads(line) for line in short_prompts_file.read_text().splitlines()[:2]]
    assert [o["id"] for o in results["outputs"]] == [p["id"] for p in prompts]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reference_target))
    for prompt, output in zip(
        load_prompts(recipe.prompts, tokenizer, 2), results["outputs"], strict=True
    ):
        with torch.no_grad():
            want = reference_sdpa.model.generate(
                torch.tensor([prompt.input_ids]), max_new_tokens=10, do_sample=False
            )
        assert output["output_ids"] == want[0, len(prompt.input_ids) :].tolist()
    for setting in results["settings"]:
        assert setting["acceptance_length"] >= 1.0
        assert (
            setting["num_target_forwards"] > 0 and setting["target_only"]["tokens_per_second"] > 0
        )
        assert setting["speedup"] > 0 and len(setting["outputs"]) == 2
        if setting["temperature"] == 0.0:
            assert setting["greedy_agreement"]["identical"] == 2


@pytest.mark.slow
def test_cli_evaluates_an_exported_draft_like_its_checkpoint(
    tmp_path: Path, reference_target: Path, random_draft_dir: Path, short_prompts_file: Path
) -> None:
    from pipelines.export.serving import export_draft

    exported = export_draft(random_draft_dir, "eagle3", tmp_path / "export", dtype="float32")
    recipe_path = tmp_path / "evaluate.yaml"
    recipe_path.write_text(
        "\n".join(
            [
                f"target: {reference_target}",
                f"draft: {random_draft_dir}",
                f"prompts: {short_prompts_file}",
                f"output_dir: {tmp_path / 'a'}",
                "limit: 2",
                "max_new_tokens: 8",
                "baseline: false",
                "warmup_tokens: 0",
                "settings:",
                "  - {draft_top_k: 3, draft_depth: 2, total_draft_tokens: 5}",
            ]
        )
    )
    assert hsstore_main(["evaluate", str(recipe_path), "--set", "device=cpu"]) == 0
    assert (
        hsstore_main(
            [
                "evaluate",
                str(recipe_path),
                "--set",
                f"draft={exported}",
                "--set",
                f"output_dir={tmp_path / 'b'}",
            ]
        )
        == 0
    )
    a = json.loads((tmp_path / "a" / "evaluation_results.json").read_text())
    b = json.loads((tmp_path / "b" / "evaluation_results.json").read_text())
    assert (a["draft_format"], b["draft_format"]) == ("project", "exported")
    assert a["settings"][0]["num_target_forwards"] == b["settings"][0]["num_target_forwards"]
    assert a["acceptance_length"] == b["acceptance_length"]


def test_a_draft_for_another_target_is_refused_before_decoding(
    tmp_path: Path, reference_target: Path, shared_data: Path, reference_sdpa: TargetModel
) -> None:
    draft = random_draft(reference_sdpa, seed=1)
    from pipelines.models.eagle3 import Eagle3Draft

    other = Eagle3Draft(draft.config.model_copy(update={"aux_layer_ids": [2, 4, 11]}))
    save_draft(other, tmp_path / "other")
    recipe = build_recipe(
        EvaluateRecipe,
        recipe_dict(
            target=str(reference_target),
            draft=str(tmp_path / "other"),
            prompts=str(shared_data / "eval_prompts.jsonl"),
            output_dir=str(tmp_path / "out"),
            device="cpu",
        ),
    )
    with pytest.raises(
        DraftMismatchError, match=r"other does not fit the target .*name layers \[11\] outside"
    ):
        run_evaluation(recipe)
    assert not (tmp_path / "out").exists()


def test_a_tree_wider_than_the_draft_vocabulary_is_refused(
    tmp_path: Path, reference_target: Path, random_draft_dir: Path, short_prompts_file: Path
) -> None:
    recipe = build_recipe(
        EvaluateRecipe,
        recipe_dict(
            target=str(reference_target),
            draft=str(random_draft_dir),
            prompts=str(short_prompts_file),
            output_dir=str(tmp_path / "out"),
            device="cpu",
            settings=[
                {"num_draft_tokens": 2},
                {"draft_top_k": 9000, "draft_depth": 2, "total_draft_tokens": 8},
            ],
        ),
    )
    with pytest.raises(
        RecipeError, match=r"settings.1 \(tree-9000-2-8-greedy\): draft_top_k=9000 exceeds the 8192"
    ):
        run_evaluation(recipe)


def test_a_missing_proxy_store_is_refused_before_anything_runs(
    tmp_path: Path, reference_target: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """proxy.store is checked first: a typo costs a second, not every prompt of every setting."""
    import pipelines.evaluate.runner as runner

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded before proxy.store was checked")

    monkeypatch.setattr(runner, "load_causal_lm", no_model)
    recipe = build_recipe(
        EvaluateRecipe,
        recipe_dict(
            target=str(reference_target),
            draft=str(tmp_path / "draft"),
            prompts=str(shared_data / "eval_prompts.jsonl"),
            output_dir=str(tmp_path / "out"),
            device="cpu",
            proxy={"store": str(tmp_path / "no-such-store")},
        ),
    )
    with pytest.raises(RecipeError, match=r"proxy.store: .*no-such-store: no committed store here"):
        run_evaluation(recipe)
    assert not (tmp_path / "out").exists()
