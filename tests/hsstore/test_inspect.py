"""hsstore.inspect and ``hsstore inspect`` on synthetic stores with known contents, damaged ones included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hsstore
from hsstore import inspect as hi
from hsstore.errors import HsstoreError
from pipelines.cli import main as cli_main
from tests.support.paths import REFERENCE_TARGET
from tests.support.stores import HIDDEN, NUM_AUX, make_lineage, make_sample, make_specs, write_store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def outlier_samples(num_samples: int = 6, num_tokens: int = 50) -> list[dict]:
    """Gaussian features, except channel 7 of the second aux layer (h4), which is 40x larger on
    every fifth token: the kind of outlier channel real LLMs have."""
    samples = [make_sample(i, num_tokens, seed=3) for i in range(num_samples)]
    for sample in samples:
        sample["features"]["aux_hidden_states"][::5, 1, 7] *= 40.0
    return samples


def write_samples(url: str, samples: list[dict], codec: str = "bf16", shard_max_tokens: int = 120, **lineage) -> hsstore.Store:
    with hsstore.StoreWriter(url, make_specs(codec), make_lineage(**lineage), shard_max_tokens=shard_max_tokens) as writer:
        for sample in samples:
            writer.add_sample(**sample)
    return hsstore.open_store(url)


def flip_a_byte(store: hsstore.Store, shard_index: int) -> str:
    """Flip one byte of the first feature file of shard ``shard_index``; returns that shard's id."""
    shard = store.shards[shard_index]
    entry = next(e for e in shard.files if "/aux_hidden_states/c/" in e.path)
    path = Path(store.location.path(entry.path))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return shard.shard_id


def test_sample_table_views_match_the_samples_written(tmp_path):
    samples = write_store(str(tmp_path / "s"), num_samples=12, seed=1)
    store = hsstore.open_store(tmp_path / "s")
    frame = hi.samples_frame(store)
    assert list(frame["sample_id"]) == [s["sample_id"] for s in samples]
    assert list(frame["num_tokens"]) == [len(s["input_ids"]) for s in samples]
    assert list(frame["num_loss_tokens"]) == [int(s["loss_mask"].sum()) for s in samples]
    assert frame.attrs["skipped_shards"] == {}

    lengths = np.array([len(s["input_ids"]) for s in samples])
    histogram = hi.length_histogram(store, bins=5)
    assert histogram["count"].sum() == len(samples) and len(histogram) == 5
    assert histogram["hi"].iloc[-1] == lengths.max()

    coverage = hi.loss_mask_coverage(store)
    total_loss = sum(int(s["loss_mask"].sum()) for s in samples)
    assert coverage["num_loss_tokens"] == total_loss
    assert coverage["loss_token_fraction"] == pytest.approx(total_loss / lengths.sum(), abs=1e-4)
    assert coverage["samples_without_loss_tokens"] == sum(1 for s in samples if s["loss_mask"].sum() == 0)

    ids = np.concatenate([s["input_ids"] for s in samples])
    masked = np.concatenate([s["input_ids"][s["loss_mask"].astype(bool)] for s in samples])
    frequency = hi.token_frequency(store, top=None)
    expected = np.bincount(masked, minlength=1000)
    assert frequency["count_loss"].iloc[0] == expected.max()
    assert frequency["count_loss"].sum() == len(masked)
    assert frequency["count_all"].sum() == len(ids)
    assert frequency["cum_share_loss"].iloc[-1] == pytest.approx(1.0)
    assert hi.vocab_coverage(frequency, sizes=(1, 10**6)) == {1: round(expected.max() / len(masked), 4), 10**6: 1.0}
    assert len(hi.token_frequency(store, top=5)) == 5

    parts = hi.bytes_per_token(store).set_index("part")
    assert parts.loc["aux_hidden_states", "raw_bytes_per_token"] == 2 * NUM_AUX * HIDDEN
    assert parts.loc["total", "bytes_per_token"] == store.info()["bytes_per_token"]


def test_layer_stats_find_the_outlier_channel(tmp_path):
    store = write_samples(str(tmp_path / "s"), outlier_samples())
    stats = hi.layer_stats(store, max_tokens=10_000).set_index("layer")
    assert list(stats.index) == ["h2", "h4", "h5", "final"]  # aux ids [2, 4, 5] from the lineage
    assert (stats["num_tokens"] == store.num_tokens).all()
    h4, h2 = stats.loc["h4"], stats.loc["h2"]
    assert h4["top_channels"][0] == 7
    assert h4["frac_6sigma"] > 0.001 and h2["frac_6sigma"] < 0.0005
    assert h4["kurtosis"] > 20 and abs(h2["kurtosis"]) < 1  # Gaussian: excess kurtosis about 0
    assert h4["channel_rms_ratio"] > 10 and h2["channel_rms_ratio"] < 2
    # Standard normal values: token norm about sqrt(H).
    assert h2["norm_mean"] == pytest.approx(np.sqrt(HIDDEN), rel=0.1)

    few = hi.layer_stats(store, max_tokens=60)
    assert (few["num_tokens"] == 60).all()  # spread over the shards, capped at max_tokens


def test_token_frame_norms_are_those_of_the_decoded_sample(tmp_path):
    store = write_samples(str(tmp_path / "s"), outlier_samples(num_samples=3))
    frame = hi.token_frame(store, 1)
    sample = store.read_sample(1, as_numpy=True)
    assert list(frame["token_id"]) == list(sample["input_ids"])
    assert list(frame["loss_mask"]) == list(sample["loss_mask"])
    np.testing.assert_allclose(frame["norm_h4"], np.linalg.norm(sample["aux_hidden_states"][:, 1], axis=-1), rtol=1e-6)
    np.testing.assert_allclose(frame["maxabs_final"], np.abs(sample["final_hidden_state"]).max(axis=-1))
    assert "token" not in frame  # no tokenizer in this lineage: nothing to decode with
    assert frame.attrs["sample_id"] == sample["sample_id"]


def test_compare_stores_measures_the_fp8_error_and_zero_against_itself(tmp_path):
    samples = outlier_samples()
    bf16 = write_samples(str(tmp_path / "bf16"), samples)
    fp8 = write_samples(str(tmp_path / "fp8"), samples, codec="fp8_e4m3", shard_max_tokens=10_000)
    same = hi.compare_stores(bf16, bf16)
    assert (same["rel_error"] == 0).all() and np.allclose(same["cosine_min"], 1.0)
    diff = hi.compare_stores(bf16, fp8).set_index("layer")
    assert diff.attrs["common_samples"] == len(samples) and diff.attrs["mismatched_samples"] == 0
    assert (diff["num_tokens"] == bf16.num_tokens).all()
    assert ((diff["rel_error"] > 1e-3) & (diff["rel_error"] < 0.06)).all()
    assert (diff["cosine_mean"] > 0.99).all()
    # The outlier channel stretches h4's per-row scale: its error is the largest.
    assert diff.loc["h4", "max_abs_error"] == diff["max_abs_error"].max()
    assert list(diff["codec_b"].unique()) == ["fp8_e4m3"]


def test_compare_stores_skips_samples_whose_tokens_differ(tmp_path):
    samples = outlier_samples(num_samples=4)
    a = write_samples(str(tmp_path / "a"), samples)
    samples[2]["input_ids"] = samples[2]["input_ids"] + 1
    b = write_samples(str(tmp_path / "b"), samples)
    diff = hi.compare_stores(a, b)
    assert diff.attrs["mismatched_samples"] == 1
    assert (diff["num_tokens"] == a.num_tokens - len(samples[2]["input_ids"])).all()


def test_a_flipped_byte_names_the_shard_and_the_rest_is_still_summarised(tmp_path):
    store = write_samples(str(tmp_path / "s"), outlier_samples(num_samples=8), shard_max_tokens=100)
    assert len(store.shards) == 4
    bad = flip_a_byte(store, 1)
    health = hi.check_health(store)
    assert not health.ok and list(health.bad_shards) == [bad]
    assert "checksum" in health.bad_shards[bad][0]

    report = hi.summary(store)
    bad_samples = store.shard(bad).num_samples
    assert report["health"]["bad_shards"].keys() == {bad}
    assert report["samples"]["inspected_samples"] == store.num_samples - bad_samples
    assert report["samples"]["excluded_samples"] == bad_samples
    assert all(row["num_tokens"] == store.num_tokens - store.shard(bad).num_tokens for row in report["layer_stats"])
    text = hi.format_summary(report)
    assert f"shard {bad}:" in text and "DAMAGED" in text and "h4" in text
    frame = hi.samples_frame(store, skip_shards=health)
    assert bad not in set(frame["shard_id"]) and len(frame) == store.num_samples - bad_samples


def test_a_shard_failing_on_read_is_skipped_without_up_front_verification(tmp_path):
    store = write_samples(str(tmp_path / "s"), outlier_samples(num_samples=8), shard_max_tokens=100)
    gone = store.shards[2]
    Path(store.location.path(f"{gone.path}/samples.arrow")).unlink()
    report = hi.summary(hsstore.open_store(tmp_path / "s"), verify=False)
    assert report["health"]["checked"] == "none"
    assert list(report["health"]["bad_shards"]) == [gone.shard_id]
    assert "cannot read the sample table" in report["health"]["bad_shards"][gone.shard_id][0]
    assert report["samples"]["inspected_samples"] == store.num_samples - gone.num_samples


def test_text_is_decoded_with_the_tokenizer_the_lineage_names(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_TARGET)
    texts = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"]
    samples = []
    for i, text in enumerate(texts):
        sample = make_sample(i, 0)
        ids = np.asarray(tokenizer(text)["input_ids"], dtype=np.int32)
        rng = np.random.default_rng(i)
        sample.update(input_ids=ids, loss_mask=np.ones(len(ids), np.uint8), features={
            "aux_hidden_states": rng.standard_normal((len(ids), NUM_AUX, HIDDEN)),
            "final_hidden_state": rng.standard_normal((len(ids), HIDDEN)),
        })
        samples.append(sample)
    target = hsstore.TargetIdentity(
        name_or_path=str(REFERENCE_TARGET), architecture="Qwen3ForCausalLM", config_sha256="0" * 64,
        num_hidden_layers=8, hidden_size=HIDDEN, vocab_size=8192,
    )
    store = write_samples(str(tmp_path / "s"), samples, target=target)
    frame = hi.samples_frame(store, decode_text=True)
    assert list(frame["text"]) == texts
    tokens = hi.token_frame(store, 0)
    assert "".join(tokens["token"]) == texts[0]

    plain = write_samples(str(tmp_path / "plain"), outlier_samples(num_samples=1))
    with pytest.raises(HsstoreError, match="cannot decode text: the lineage's target None"):
        hi.samples_frame(plain, decode_text=True)
    assert list(hi.samples_frame(plain, decode_text=True, tokenizer=tokenizer)["text"])  # explicit one works


def test_plots_are_written_as_png(tmp_path):
    samples = outlier_samples()
    store = write_samples(str(tmp_path / "s"), samples)
    paths = hi.write_plots(store, tmp_path / "plots")
    assert set(paths) == {"lengths", "token_frequency", "layer_stats", "token_view"}
    fp8 = write_samples(str(tmp_path / "fp8"), samples, codec="fp8_e4m3")
    paths["comparison"] = tmp_path / "plots" / "cmp.png"
    hi.plot_comparison(hi.compare_stores(store, fp8), paths["comparison"])
    for path in paths.values():
        assert Path(path).read_bytes()[:8] == PNG_MAGIC and Path(path).stat().st_size > 5_000


def test_cli_json_plots_and_a_damaged_store(tmp_path, capsys):
    store = write_samples(str(tmp_path / "s"), outlier_samples(num_samples=8), shard_max_tokens=100)
    assert cli_main(["inspect", store.url, "--json", "--plots", str(tmp_path / "plots"), "--top-tokens", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"]["num_samples"] == 8 and report["health"]["ok"]
    assert len(report["token_frequency"]) == 3
    assert {row["layer"] for row in report["layer_stats"]} == {"h2", "h4", "h5", "final"}
    assert report["info"]["lineage"]["aux_layer_ids"] == [2, 4, 5]
    for path in report["plots"].values():
        assert Path(path).read_bytes()[:8] == PNG_MAGIC

    assert cli_main(["inspect", store.url]) == 0
    human = capsys.readouterr().out
    for heading in ("length histogram", "loss mask", "token frequency head", "hidden states per layer", "bytes per token", "health     OK"):
        assert heading in human

    bad = flip_a_byte(store, 0)
    assert cli_main(["inspect", store.url, "--plots", str(tmp_path / "plots2")]) == 1
    captured = capsys.readouterr()
    assert f"shard {bad}:" in captured.out and "hidden states per layer" in captured.out
    assert f"damaged shard(s) left out of the summary: {bad}" in captured.err
    assert (tmp_path / "plots2" / "layer_stats.png").exists()


def test_an_empty_store_is_summarised(tmp_path):
    hsstore.ensure_store(str(tmp_path / "empty"), features=make_specs(), lineage=make_lineage())
    store = hsstore.open_store(tmp_path / "empty")
    report = hi.summary(store)
    assert report["samples"]["inspected_samples"] == 0 and report["loss_mask"]["per_sample_fraction_quantiles"] == {}
    assert [row["num_tokens"] for row in report["layer_stats"]] == [0, 0, 0, 0]
    json.dumps(report)
    assert "inspected  0 samples, 0 tokens" in hi.format_summary(report)
    assert len(hi.samples_frame(store)) == 0 and len(hi.token_frequency(store)) == 0
