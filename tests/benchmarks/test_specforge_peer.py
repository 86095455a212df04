"""SpecForge 0.2.0's own offline trainer, driven by benchmarks/specforge_peer.py, on the reference
target's real features: it trains from hsstore's draft config and vocabulary, its export loads
through hsstore's ``load_draft`` with the same ``d2t``/``t2d``, and the data order we hand it is the
order its sampler visits.

Skipped where SpecForge is not installed (CI does not install it: ``pip install --no-deps
specforge==0.2.0 accelerate``)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("specforge", reason="SpecForge is not installed (pip install --no-deps specforge==0.2.0)")
pytest.importorskip("accelerate", reason="SpecForge's trainer imports accelerate (pip install accelerate)")

from pipelines.export.serving import export_draft  # noqa: E402
from pipelines.models.checkpoint import load_draft  # noqa: E402
from pipelines.train import TrainRecipe, run_training  # noqa: E402
from tests.factories import REFERENCE_TARGET  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "specforge_peer.py"
NUM_SAMPLES = 8


def _load_peer():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("specforge_peer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["specforge_peer"] = module
    spec.loader.exec_module(module)
    return module


peer = _load_peer()


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
        steps=4, lr=1e-3, warmup_steps=1, max_len=256, batch_size=2, seed=0, device="cpu", grad_clip=0.5,
        betas=(0.9, 0.95), min_lr_ratio=0.1, patch_optimizer=True, sample_order=order, align_loss_mask=True)
    losses = [m["loss"] for m in result["metrics"]]
    assert [m["step"] for m in result["metrics"]] == [1, 2, 3, 4]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    lengths = peer.sample_lengths(peer.feature_files(features))
    assert result["num_tokens"] == sum(min(256, lengths[i]) for i in order[:8])  # 4 steps x 2 samples
    assert result["tokens_per_s"] > 0 and result["train_seconds"] > 0
    assert result["shims"][:3] == ["cpu-loss", "optimizer", peer.ALIGNED_LOSS_MASK_SHIM]
    # The optimizer shim took: the last step's LR sits on hsstore's floor side of the cosine.
    assert result["metrics"][-1]["lr"] == pytest.approx(1e-4)

    draft = load_draft(result["export_dir"])
    ours = load_file(hsstore_export / "model.safetensors")
    assert torch.equal(draft.d2t.cpu(), ours["d2t"]) and torch.equal(draft.t2d.cpu(), ours["t2d"])
    assert draft.config.aux_layer_ids == [2, 4, 5]
    key = "model.embed_tokens.weight"  # the export ships the target's embedding, frozen in training
    shard = json.loads((REFERENCE_TARGET / "model.safetensors.index.json").read_text())["weight_map"][key]
    target_embed = load_file(REFERENCE_TARGET / shard)[key]
    assert torch.equal(draft.embed_tokens.weight, target_embed.to(draft.embed_tokens.weight.dtype))
