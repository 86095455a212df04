"""SpecForge 0.2.0's own offline trainer, driven by benchmarks/specforge/peer.py, on the reference
target's real features: it trains from hsstore's draft config and vocabulary, its export loads
through hsstore's ``load_draft`` with the same ``d2t``/``t2d``, and the data order we hand it is the
order its sampler visits.

Skipped where SpecForge is not installed (CI does not install it: ``pip install --no-deps
specforge==0.2.0 accelerate``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("specforge", reason="SpecForge is not installed (pip install --no-deps specforge==0.2.0)")
pytest.importorskip("accelerate", reason="SpecForge's trainer imports accelerate (pip install accelerate)")

from benchmarks.specforge import peer  # noqa: E402
from pipelines.export.serving import export_draft  # noqa: E402
from pipelines.models.checkpoint import load_draft  # noqa: E402
from pipelines.train import TrainRecipe, run_training  # noqa: E402
from tests.support.paths import REFERENCE_TARGET  # noqa: E402

NUM_SAMPLES = 8
# SpecForge's data.max_length in the tiny run: it truncates the store's 256-token samples. Its bf16
# matmuls run ~70x slower than float32 on an AVX2 CPU (~10 s a step at 256 tokens, ~2 s at 64);
# these samples' loss masks are set from their first token, so every kept position is scored.
MAX_LEN = 64


@pytest.fixture(scope="module")
def features(reference_store: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first NUM_SAMPLES samples of the reference store in SpecForge's offline layout."""
    return peer.write_features_from_store(reference_store, tmp_path_factory.mktemp("sf-features"), NUM_SAMPLES)


@pytest.fixture(scope="module")
def hsstore_export(reference_store: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An hsstore EAGLE-3 export (config.json, d2t/t2d) of a 1-step draft: SpecForge's draft config
    and vocabulary."""
    output_dir = tmp_path_factory.mktemp("hs-train")
    recipe = TrainRecipe.model_validate({
        "store": reference_store, "target": str(REFERENCE_TARGET), "output_dir": str(output_dir),
        "max_steps": 1, "draft": {"intermediate_size": 512, "vocab": {"draft_vocab_size": 1024}},
        "loader": {"token_budget": 256, "rows_per_batch": 1, "shuffle_window": 32, "read_threads": 2},
        "schedule": {"warmup_steps": 0}, "device": "cpu", "seed": 0,
    })
    run_training(recipe)
    return export_draft(output_dir, "eagle3", tmp_path_factory.mktemp("hs-export") / "draft")


def test_specforge_visits_the_ordered_view_in_the_given_order(features: Path, tmp_path: Path) -> None:
    from specforge.launch import _shard_offline_refs
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    files = peer.feature_files(features)
    assert sorted(files) == list(range(NUM_SAMPLES))
    order = [5, 2, 7, 0, 3, 3, 1, 6, 4, 0, 2]  # repeats allowed: several epochs laid end to end
    seed = 3
    view = peer.ordered_view(files, order, seed, tmp_path / "view")
    refs = _shard_offline_refs(OfflineManifestReader(str(view)).read(), use_usp_preprocess=False,
                               seed=seed, epoch=0)
    visited = [Path(ref.feature_store_uri.removeprefix("file://")).resolve() for ref in refs]
    assert visited == [files[i].resolve() for i in order]


def test_aligned_copy_makes_specforge_score_hsstores_positions(features: Path, tmp_path: Path) -> None:
    """SpecForge scores (t, depth i) iff mask[t + i] (its offline shift); on the aligned copy that is
    hsstore's rule, loss_mask[t + 2 + i] with token t + 2 + i inside the sample."""
    files = peer.feature_files(features)
    copies = peer.aligned_loss_mask_copy(files, [1, 4], tmp_path / "aligned")
    assert sorted(copies) == [1, 4]
    for sample, path in copies.items():
        original = torch.load(files[sample], weights_only=True)["loss_mask"]
        aligned = torch.load(path, weights_only=True)["loss_mask"]
        length = original.numel()
        for depth in range(7):
            specforge = {t for t in range(length - 1 - depth) if aligned[t + depth]}  # last position: 0
            hsstore = {t for t in range(length) if t + 2 + depth < length and original[t + 2 + depth]}
            assert specforge == hsstore


def test_a_previous_run_is_cleared_and_anything_else_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "train" / "specforge-run-step4").mkdir(parents=True)  # SpecForge would resume from it
    (run / "specforge.yaml").write_text("old")
    peer._clear_previous_run(run, overwrite=False)
    assert run.is_dir() and not any(run.iterdir())
    (run / "notes.txt").write_text("mine")
    with pytest.raises(peer.SpecForgeRunError, match=r"holds \['notes.txt'\], not a train_specforge run"):
        peer._clear_previous_run(run, overwrite=False)
    peer._clear_previous_run(run, overwrite=True)
    assert not any(run.iterdir())


def test_optimizer_knobs_specforge_lacks_are_refused_unless_patched() -> None:
    with pytest.raises(peer.SpecForgeRunError, match=r"no knob for \['betas', 'min_lr_ratio'\]"):
        peer._shims(False, False, (0.9, 0.95), 0.0, 0.1)
    assert peer._shims(False, False, (0.9, 0.999), 0.0, 0.0) == {}  # CUDA, SpecForge's own: no shim
    assert set(peer._shims(True, True, (0.9, 0.95), 0.0, 0.1)) == {"cpu-loss", "optimizer"}


@pytest.mark.slow
def test_tiny_run_trains_exports_and_loads_through_load_draft(
    features: Path, hsstore_export: Path, reference_store: str, tmp_path: Path
) -> None:
    order = peer.hsstore_sample_order(reference_store, seed=0, token_budget=256, rows_per_batch=1,
                                      shuffle_window=32, epochs=1)
    order = [i for i in order if i < NUM_SAMPLES]
    result: dict[str, Any] = peer.train_specforge(
        features, hsstore_export / "config.json", hsstore_export, REFERENCE_TARGET, tmp_path / "sf",
        steps=4, lr=1e-3, warmup_steps=1, max_len=MAX_LEN, batch_size=2, seed=0, device="cpu", grad_clip=0.5,
        betas=(0.9, 0.95), min_lr_ratio=0.1, patch_optimizer=True, sample_order=order, align_loss_mask=True)
    losses = [m["loss"] for m in result["metrics"]]
    assert [m["step"] for m in result["metrics"]] == [1, 2, 3, 4]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    lengths = peer.sample_lengths(peer.feature_files(features))
    assert result["num_tokens"] == sum(min(MAX_LEN, lengths[i]) for i in order[:8])  # 4 steps x 2 samples
    assert result["tokens_per_s"] > 0 and result["train_seconds"] > 0
    assert result["shims"][:3] == ["cpu-loss", "optimizer", peer.ALIGNED_LOSS_MASK_SHIM]
    # The optimizer shim took: the last step's LR sits on hsstore's floor side of the cosine.
    assert result["metrics"][-1]["lr"] == pytest.approx(1e-4)

    draft = load_draft(result["export_dir"])
    ours = load_file(hsstore_export / "model.safetensors")
    assert torch.equal(draft.d2t.cpu(), ours["d2t"]) and torch.equal(draft.t2d.cpu(), ours["t2d"])
    assert draft.config.aux_layer_ids == [2, 4, 5]
    target_embed = _target_tensor("model.embed_tokens.weight")  # the export ships it (frozen in training)
    assert torch.equal(draft.embed_tokens.weight, target_embed.to(draft.embed_tokens.weight.dtype))

    # `hsstore evaluate`'s loader takes it too (checks it fits the target, installs its embedding).
    from transformers import AutoModelForCausalLM

    from pipelines.evaluate.runner import load_evaluation_draft

    target = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=torch.float32)
    loaded, _ = load_evaluation_draft(result["export_dir"], target, torch.float32, torch.device("cpu"))
    assert torch.equal(loaded.d2t, ours["d2t"])


@pytest.mark.gpu
@pytest.mark.slow
def test_on_cuda_specforge_runs_unpatched(features: Path, hsstore_export: Path, tmp_path: Path) -> None:
    """On the GPU SpecForge runs as its users run it: its Triton loss, FSDP, flex attention, no
    shim (SpecForge's own AdamW betas and cosine to 0)."""
    result = peer.train_specforge(
        features, hsstore_export / "config.json", hsstore_export, REFERENCE_TARGET, tmp_path / "sf",
        steps=4, lr=1e-3, warmup_steps=1, max_len=256, batch_size=2, seed=0, device="cuda", grad_clip=0.5)
    assert result["shims"] == []
    losses = [m["loss"] for m in result["metrics"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    draft = load_draft(result["export_dir"])
    assert torch.equal(draft.d2t.cpu(), load_file(hsstore_export / "model.safetensors")["d2t"])


def _target_tensor(key: str) -> torch.Tensor:
    """One tensor of the reference target, by name, through its safetensors index."""
    shard = json.loads((REFERENCE_TARGET / "model.safetensors.index.json").read_text())["weight_map"][key]
    return load_file(REFERENCE_TARGET / shard)[key]


def _specforge_step_sums(draft: Any, config_path: Path, raw: dict[str, torch.Tensor], length: int) -> list[float]:
    """SpecForge's own offline forward (its normaliser, target head shift, OnlineEagle3Model with
    sdpa) on one sample, with ``draft``'s weights: per-depth summed cross-entropy (its ``ploss_i``
    times B*T, undoing its per-position mean)."""
    import json as json_module

    from benchmarks.specforge import shims

    shims._install_cpu_loss()  # no Triton on the CPU
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from transformers import LlamaConfig

    config = json_module.loads(config_path.read_text())
    sf_draft = LlamaForCausalLMEagle3(LlamaConfig(**config), attention_backend="sdpa").float()
    sf_draft.load_state_dict(draft.state_dict(), strict=True)
    batch = normalize_offline_sample(raw, max_len=length)
    head = TargetHead(str(REFERENCE_TARGET))
    head.load_weights(str(REFERENCE_TARGET))
    input_ids, target, loss_mask = head.float().preprocess(batch["input_ids"], batch["target"], batch["loss_mask"])
    with torch.no_grad():
        plosses, *_ = OnlineEagle3Model(sf_draft, length=7, attention_backend="sdpa")(
            input_ids=input_ids, attention_mask=batch["attention_mask"], loss_mask=loss_mask,
            target=head(target), hidden_states=batch["hidden_state"])
    return [float(p) * length for p in plosses]


@pytest.mark.slow
def test_specforges_forward_equals_hsstores_once_the_mask_is_aligned(
    hsstore_export: Path, reference_store: str
) -> None:
    """Same weights, same sample: SpecForge's per-depth loss sums equal hsstore's (float32, 1e-5)
    when its loss mask is shifted by two, and differ without the shift on a sample where an
    assistant span starts: the TTT alignment, attention, RoPE, norms and teacher are the same, and
    docs/vs-specforge.md's item 1 is real."""
    import hsstore
    from pipelines.train.teacher import teacher_from_final_hidden
    from pipelines.train.ttt import ttt_forward

    store = hsstore.open_store(reference_store)
    samples = [store.read_sample(i) for i in range(store.num_samples)]
    sample = next(s for s in samples if 0 < int(s["loss_mask"][:-8].sum()) < len(s["loss_mask"]) - 8
                  and not bool(s["loss_mask"][0]))  # a span that starts inside the sample
    length = int(sample["input_ids"].numel())
    draft = load_draft(hsstore_export, dtype=torch.float32, embed_tokens=_target_tensor("model.embed_tokens.weight"))
    torch.manual_seed(0)
    with torch.no_grad():  # move the norms off 1 so that a misplaced norm would show
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    raw = {"input_ids": sample["input_ids"].long(), "loss_mask": sample["loss_mask"].long(),
           "hidden_state": sample["final_hidden_state"].float()[None],
           "aux_hidden_state": sample["aux_hidden_states"].float().reshape(1, length, -1)}
    aligned = torch.zeros_like(raw["loss_mask"])
    aligned[:-2] = raw["loss_mask"][2:]

    lm_head = _target_tensor("lm_head.weight").float()
    teacher = teacher_from_final_hidden(raw["hidden_state"], lm_head, draft.d2t, draft.t2d)
    with torch.no_grad():
        ours = ttt_forward(draft, raw["aux_hidden_state"].reshape(1, length, 3, -1), raw["input_ids"][None],
                           torch.arange(length)[None], raw["loss_mask"][None], teacher.probs_BTV, teacher.valid_BT,
                           attention="eager")
    ours_sums = [float(v) for v in ours.step_loss_sums]
    assert min(int(c) for c in ours.step_counts) > 0
    theirs_aligned = _specforge_step_sums(draft, hsstore_export / "config.json", {**raw, "loss_mask": aligned}, length)
    assert theirs_aligned == pytest.approx(ours_sums, rel=1e-5)
    theirs_as_stored = _specforge_step_sums(draft, hsstore_export / "config.json", raw, length)
    assert theirs_as_stored != pytest.approx(ours_sums, rel=1e-5)

