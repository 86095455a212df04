"""Bad and hostile input: each gets a clear error naming the thing (file and line, dotted recipe
key, manifest path or shard), and nothing already committed is lost.

Not repeated here: the per-reason record rejections (tests/pipelines/extract/test_records.py) and
the manifest parser's own cases (tests/hsstore/test_manifest.py). This module covers what those do
not: input that crashes rather than rejects, recipes of every job, manifests reached through
``open_store`` and ``verify`` (not just the parser), and hostile files inside a shard.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest

import hsstore
from hsstore import ManifestError, RecipeError, ShardCorruptError, StoreLocation, StoreNotFoundError
from hsstore.verify import verify_store
from pipelines.extract.records import Record, Rejection, RejectReason, iter_records
from tests.support.paths import REFERENCE_TARGET
from tests.support.stores import make_lineage, make_sample, make_specs, write_store

pytestmark = pytest.mark.reliability


def read_lines(tmp_path: Path, data: bytes) -> list[Record | Rejection]:
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(data)
    return list(iter_records([str(path)]))


# -- records ------------------------------------------------------------------------------------


def test_a_utf8_bom_costs_no_record_silently(tmp_path):
    """Files saved by Windows tools start with a BOM. Today the first record is rejected (counted,
    named, with Python's hint to use utf-8-sig); it is never dropped silently."""
    items = read_lines(tmp_path, b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert len(items) == 2
    first = items[0]
    if isinstance(first, Rejection):
        assert first.reason == RejectReason.NOT_JSON and first.origin == "hostile.jsonl:1"
        assert "BOM" in first.message
    else:
        assert first.text == "first"


def plan_hostile(tmp_path: Path, data: bytes, **batching: object):
    """The streaming planner (the path ``hsstore extract`` takes) over ``data`` as hostile.jsonl."""
    from tests.pipelines.extract.helpers import make_recipe, plan_recipe

    path = tmp_path / "hostile.jsonl"
    path.write_bytes(data)
    recipe = make_recipe(REFERENCE_TARGET, [path], tmp_path / "store", batching=batching, planning={"num_workers": 1})
    return plan_recipe(recipe)


def test_a_huge_record_is_counted_too_long_not_truncated_silently(tmp_path):
    huge = json.dumps({"id": "huge", "text": "word " * 200_000}).encode()
    data = huge + b"\n" + b'{"id": "small", "text": "a small record"}\n'
    dropped = plan_hostile(tmp_path, data, max_length=128, too_long="drop")
    assert [s.source_id for s in dropped.samples] == ["small"]
    assert dropped.rejected_by_reason == {"too_long": 1}
    assert "hostile.jsonl:1" in dropped.rejections[0].message and "over max_length=128" in dropped.rejections[0].message
    truncated = plan_hostile(tmp_path, data, max_length=128, too_long="truncate")
    assert truncated.num_truncated == 1 and len(truncated.samples[0].input_ids) == 128
    assert [s.source_id for s in truncated.samples] == ["huge", "small"]


def test_deeply_nested_json_is_a_rejection_not_a_crash(tmp_path):
    line = b"{\"text\": " + b"[" * 5_000 + b"]" * 5_000 + b"}"
    items = read_lines(tmp_path, line + b'\n{"text": "next"}\n')
    assert isinstance(items[0], Rejection) and items[0].reason == RejectReason.NOT_JSON
    assert items[0].origin == "hostile.jsonl:1" and isinstance(items[1], Record)


def test_an_oversized_integer_is_a_rejection_not_a_crash(tmp_path):
    items = read_lines(tmp_path, b'{"id": ' + b"9" * 5000 + b', "text": "x"}\n{"text": "next"}\n')
    assert isinstance(items[0], Rejection) and items[0].origin == "hostile.jsonl:1"
    assert isinstance(items[1], Record)


def test_a_lone_surrogate_is_a_rejection_not_a_crash(tmp_path):
    data = b'{"id": "bad", "text": "broken \\ud800 text"}\n{"id": "good", "text": "fine"}\n'
    plan = plan_hostile(tmp_path, data, max_length=64)
    assert [s.source_id for s in plan.samples] == ["good"]
    assert len(plan.rejections) == 1 and "hostile.jsonl:1" in plan.rejections[0].message


# -- recipes: every job's model, errors with the dotted key ----------------------------------------


def recipe_models() -> dict[str, tuple[type, dict]]:
    """Each job's recipe model with a minimal valid mapping."""
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.sweep.recipe import SweepRecipe
    from pipelines.train.config import TrainRecipe

    train = {"store": "s", "target": "t", "output_dir": "o"}
    models: dict[str, tuple[type, dict]] = {
        "extract": (ExtractRecipe, {"target": "t", "data": ["d.jsonl"], "store": "s"}),
        "train": (TrainRecipe, train),
        "sweep": (SweepRecipe, {"base": train, "output_dir": "o"}),
    }
    try:
        from pipelines.evaluate.recipe import EvaluateRecipe
    except ImportError:
        pass
    else:
        evaluate = {"target": "t", "draft": "d", "prompts": "p.jsonl", "output_dir": "o", "settings": [{"num_draft_tokens": 3}]}
        models["evaluate"] = (EvaluateRecipe, evaluate)
    return models


JOBS = ["extract", "train", "sweep", "evaluate"]


def build(job: str, overrides: list[str]):
    from pipelines.recipe import build_recipe

    models = recipe_models()
    if job not in models:
        pytest.skip(f"the {job} recipe model has not landed (pipelines/{job}/recipe.py)")
    model, base = models[job]
    return build_recipe(model, base, overrides, source=f"{job}.yaml")


@pytest.mark.parametrize("job", JOBS)
def test_every_recipe_names_an_unknown_nested_key(job):
    build(job, [])  # the minimal mapping is valid
    with pytest.raises(RecipeError, match=rf"invalid recipe {job}.yaml:\n  surprise: unknown key"):
        build(job, ["surprise=1"])


@pytest.mark.parametrize(
    ("job", "override", "dotted"),
    [
        ("extract", "batching.max_length=many", "batching.max_length"),
        ("extract", "units.max_tokens=-5", "units.max_tokens"),
        ("extract", "codecs.aux_hidden_states.codec=fp4", "codecs.aux_hidden_states.codec"),
        ("extract", "ray.max_restarts=[1]", "ray.max_restarts"),
        ("extract", "capture.aux_layer_ids=two", "capture.aux_layer_ids"),
        ("extract", "batching.typo_key=1", "batching.typo_key"),
        ("train", "optimizer.lr=fast", "optimizer.lr"),
        ("train", "loader.token_budget=0", "loader.token_budget"),
        ("train", "draft.vocab.typo=1", "draft.vocab.typo"),
        ("train", "skip_corrupt=maybe", "skip_corrupt"),
        ("sweep", "grid.ttt_length=[]", "grid"),
        ("evaluate", "max_new_tokens=-1", "max_new_tokens"),
        ("evaluate", "settings=[{num_draft_tokens: two}]", "settings.0.num_draft_tokens"),
        ("evaluate", "proxy.fraction=lots", "proxy.fraction"),
        ("sweep", "ray.num_cpus_per_point=0", "ray.num_cpus_per_point"),
    ],
)
def test_wrong_types_and_values_name_the_dotted_key(job, override, dotted):
    with pytest.raises(RecipeError, match=rf"invalid recipe {job}.yaml:\n(.*\n)*  {dotted}: "):
        build(job, [override])


@pytest.mark.parametrize(
    ("job", "overrides", "message"),
    [
        ("train", ["model=eagle4", "draft.sliding_window=4", "ttt_length=7"], r"draft.sliding_window=4 is smaller than ttt_length=7"),
        ("train", ["stage=candidate_head"], r"candidate_head.draft_checkpoint is required"),
        ("train", ["draft.vocab.full=true", "draft.vocab.draft_vocab_size=100"], r"draft.vocab: Value error, set exactly one of draft_vocab_size, vocab_file, full: true \(found draft_vocab_size, full\)"),
        ("extract", ["batching.max_length=8192", "batching.token_budget=4096"], r"token_budget \(4096\) must be >= max_length \(8192\)"),
        ("extract", ["capture.final_hidden_state=false"], r"target_distribution=final_hidden needs final_hidden_state: true"),
        ("sweep", ["overrides={candidate_head.rank: 8}"], r"candidate_head.rank only changes stage 2"),
        ("evaluate", ["settings=[{num_draft_tokens: 3, draft_top_k: 2}]"], r"settings.0: Value error, give either num_draft_tokens \(a chain\) or"),
        ("evaluate", ["settings=[{num_draft_tokens: 3, top_p: 0.5}]"], r"top_p applies only when sampling"),
        ("evaluate", ["settings=[{num_draft_tokens: 3}, {num_draft_tokens: 3}]"], r"settings share the label"),
    ],
)
def test_contradictory_settings_are_refused_before_any_work(job, overrides, message):
    with pytest.raises(RecipeError, match=message):
        build(job, overrides)


def test_a_sweep_point_with_a_contradiction_fails_at_expansion_naming_the_point():
    from pipelines.sweep.recipe import expand

    recipe = build("sweep", ["base.model=eagle4", "base.draft.sliding_window=6", "grid.ttt_length=[3,7]"])
    with pytest.raises(RecipeError, match=r"sliding_window=6 is smaller than ttt_length=7"):
        expand(recipe)


def test_missing_required_keys_are_named():
    with pytest.raises(RecipeError, match=r"  store: Field required"):
        from pipelines.extract.recipe import ExtractRecipe
        from pipelines.recipe import build_recipe

        build_recipe(ExtractRecipe, {"target": "t", "data": ["d.jsonl"]}, source="extract.yaml")


def test_recipe_files_that_are_not_mappings_or_not_yaml_name_the_file(tmp_path):
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    for text, message in [("- a\n- list\n", "must hold a mapping, found list"), ("a: [unclosed\n", "is not valid YAML"), ("!!python/object/apply:os.system ['true']\n", "is not valid YAML")]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(RecipeError, match=rf"recipe file {path} {message}"):
            load_recipe(ExtractRecipe, path)
    with pytest.raises(RecipeError, match=r"recipe file .*nowhere.yaml does not exist"):
        load_recipe(ExtractRecipe, tmp_path / "nowhere.yaml")


def test_missing_paths_are_named_before_the_target_runs(tmp_path, monkeypatch):
    from pipelines.extract import run_extraction
    from pipelines.extract.errors import RecordSourceError, TargetNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the sandbox has no hub; say so fast
    build_args = {"store": str(tmp_path / "store")}
    recipe = build("extract", [f"target={tmp_path / 'no-such-model'}", f"store={build_args['store']}"])
    with pytest.raises(TargetNotFoundError, match=r"no-such-model' is not a local directory"):
        run_extraction(recipe)
    recipe = build("extract", [f"target={REFERENCE_TARGET}", f"data=[{tmp_path / 'no-such.jsonl'}]", f"store={build_args['store']}"])
    with pytest.raises(RecordSourceError, match=r"data file .*no-such.jsonl does not exist"):
        run_extraction(recipe)
    assert not (tmp_path / "store" / "manifest.json").exists()


# -- manifests and shard files, through open_store and verify ---------------------------------------


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    url = tmp_path / "store"
    write_store(str(url), num_samples=12, shard_max_tokens=120)
    return url


def edit_manifest(store_dir: Path, change) -> None:
    path = store_dir / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def problems(store_dir: Path) -> list[str]:
    return [str(p) for p in verify_store(StoreLocation(str(store_dir))) if p.fatal]


def test_unknown_format_version_is_refused_by_open_and_verify(store_dir):
    edit_manifest(store_dir, lambda m: m.update(format_version=2))
    with pytest.raises(ManifestError, match=rf"{store_dir}/manifest.json: format_version 2 is not supported"):
        hsstore.open_store(str(store_dir))
    assert problems(store_dir) == [
        f"manifest: manifest.json: {store_dir}/manifest.json: format_version 2 is not supported by this "
        "hsstore (supported: [1]); upgrade hsstore to read this store"
    ]


@pytest.mark.parametrize("path", ["../elsewhere", "/etc", "s3://other-bucket/x", "file:///etc", "shards/../../x"])
def test_shard_paths_leaving_the_store_are_refused_by_open_and_verify(store_dir, path):
    edit_manifest(store_dir, lambda m: m["shards"][0].update(path=path))
    with pytest.raises(ManifestError, match=r"shards\.0\.path"):
        hsstore.open_store(str(store_dir))
    assert len(problems(store_dir)) == 1 and problems(store_dir)[0].startswith("manifest:")


def _grow_sample_tokens(shard: dict, tokens: int = 0, samples: int = 0) -> None:
    """Keep the per-sample lengths the manifest records consistent with an edited count, so the
    manifest stays self-consistent and only the files disagree."""
    from hsstore.manifest import decode_sample_tokens, encode_sample_tokens

    if shard.get("sample_tokens") is None:
        return
    lengths = list(decode_sample_tokens(shard["sample_tokens"]))
    lengths[-1] += tokens
    lengths += [0] * samples
    shard["sample_tokens"] = encode_sample_tokens(lengths)


def test_token_counts_that_disagree_with_the_files_are_named(store_dir):
    def grow(m: dict) -> None:
        m["shards"][1]["num_tokens"] += 5
        m["num_tokens"] += 5
        _grow_sample_tokens(m["shards"][1], tokens=5)

    edit_manifest(store_dir, grow)
    store = hsstore.open_store(str(store_dir))  # self-consistent manifest: opens
    shard = store.shards[1]
    found = problems(store_dir)
    assert any(p.startswith("tokens: ") and shard.path in p and "manifest says" in p for p in found), found
    assert any(p.startswith("shape: ") and shard.path in p for p in found), found
    with pytest.raises(ShardCorruptError, match=rf"{shard.path}/features.zarr/aux_hidden_states: \d+ tokens, manifest says {shard.num_tokens}"):
        store.read_token_range(shard.shard_id, 0, 1, ["aux_hidden_states"])


def test_row_counts_that_disagree_with_the_table_are_named(store_dir):
    def grow(m: dict) -> None:
        m["shards"][0]["num_samples"] += 1
        m["num_samples"] += 1
        _grow_sample_tokens(m["shards"][0], samples=1)

    edit_manifest(store_dir, grow)
    store = hsstore.open_store(str(store_dir))
    with pytest.raises(ShardCorruptError, match=r"samples.arrow: \d+ rows, manifest says"):
        store.samples  # noqa: B018
    assert any(p.startswith("rows: ") for p in problems(store_dir))


def test_feature_shapes_that_disagree_with_the_arrays_are_named(store_dir):
    edit_manifest(store_dir, lambda m: m["features"][0].update(shape=[3, 32]))
    found = problems(store_dir)
    assert found and all(p.startswith("shape: ") and "aux_hidden_states" in p for p in found), found


def test_duplicate_sample_ids_across_shards_are_named(tmp_path):
    url = str(tmp_path / "store")
    specs, lineage = make_specs(), make_lineage()
    records = []
    for shard_id in ("a", "b"):
        writer = hsstore.ShardWriter(url, shard_id, specs)
        writer.add_sample(**make_sample(7, 5))  # the same sample in both shards
        records.append(writer.finish())
    hsstore.commit_shards(url, records, features=specs, lineage=lineage)
    found = [str(p) for p in verify_store(StoreLocation(url)) if p.fatal]
    assert len(found) == 1 and found[0].startswith("duplicate: shards/b.") and "sample_id 'sample-00007' also in shard a" in found[0]


def test_an_empty_or_missing_manifest_is_named(tmp_path, store_dir):
    with pytest.raises(StoreNotFoundError, match=r"no committed store here \(manifest.json not found\)"):
        hsstore.open_store(str(tmp_path / "nothing"))
    (store_dir / "manifest.json").write_bytes(b"")
    with pytest.raises(ManifestError, match=r"manifest.json: not valid JSON"):
        hsstore.open_store(str(store_dir))


def test_a_symlinked_shard_folder_pointing_outside_fails_verification(store_dir, tmp_path):
    """A manifest cannot name a path outside the store; a symlink planted inside it is caught by
    the checksums (its files are not the ones committed)."""
    store = hsstore.open_store(str(store_dir))
    victim = store_dir / store.shards[0].path
    outside = tmp_path / "outside"
    shutil.copytree(store_dir / store.shards[1].path, outside)
    shutil.rmtree(victim)
    victim.symlink_to(outside)
    found = problems(store_dir)
    assert found and all(store.shards[0].path in p for p in found)


def test_a_hostile_codec_in_a_shard_is_refused_not_run(store_dir):
    """A shard's zarr.json asking for a pickle codec: the reader refuses the array (zarr has no
    such codec registered) and verify names both the checksum and the file."""
    store = hsstore.open_store(str(store_dir))
    shard = store.shards[0]
    meta_path = store_dir / shard.path / "features.zarr" / "final_hidden_state" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"] = [{"name": "numcodecs.pickle", "configuration": {"protocol": 5}}]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ShardCorruptError, match=r"final_hidden_state: cannot open"):
        hsstore.open_store(str(store_dir)).read_token_range(shard.shard_id, 0, 1, ["final_hidden_state"])
    assert any(p.startswith(("checksum: ", "size: ")) and "final_hidden_state/zarr.json" in p for p in problems(store_dir))


def test_a_pickled_arrow_extension_type_is_never_unpickled(store_dir, tmp_path):
    """pyarrow's legacy ``arrow.py_extension_type`` was deserialised with pickle (CVE-2023-47248).
    A sample table carrying one must not run the payload when a reader opens it."""
    import pickle

    import pyarrow as pa

    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    store = hsstore.open_store(str(store_dir))
    shard = store.shards[0]
    table_path = store_dir / shard.path / "samples.arrow"
    # Read into memory and replace the file (a memory-mapped table truncated in place would SIGBUS).
    table = pa.ipc.open_file(pa.BufferReader(table_path.read_bytes())).read_all()
    field = pa.field(
        "source_id",
        pa.string(),
        metadata={b"ARROW:extension:name": b"arrow.py_extension_type", b"ARROW:extension:metadata": pickle.dumps(Payload())},
    )
    schema = table.schema.set(table.schema.get_field_index("source_id"), field)
    hostile = tmp_path / "samples.arrow"
    with pa.ipc.new_file(str(hostile), schema) as writer:
        writer.write_table(table.cast(schema))
    hostile.replace(table_path)
    fresh = hsstore.open_store(str(store_dir))
    # Refusing the table is as good as ignoring the payload; running it is the failure.
    with contextlib.suppress(Exception):
        fresh.samples.to_pandas()
    hsstore.verify_store(StoreLocation(str(store_dir)))
    assert not marker.exists()
