"""The manifest parser: version gate, hostile paths, inconsistent counts, fuzzing."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hsstore
from hsstore import ManifestError, parse_manifest
from tests.support.stores import write_store


@pytest.fixture
def manifest_dict(tmp_path):
    url = str(tmp_path / "store")
    write_store(url, num_samples=14)
    return json.loads((tmp_path / "store" / "manifest.json").read_text())


def parse(data: dict) -> hsstore.StoreManifest:
    return parse_manifest(json.dumps(data), source="/stores/x/manifest.json")


def test_round_trip(manifest_dict):
    manifest = parse(manifest_dict)
    assert parse_manifest(manifest.to_json()) == manifest


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_unknown_format_version_is_refused(manifest_dict, version):
    manifest_dict["format_version"] = version
    with pytest.raises(ManifestError, match=r"/stores/x/manifest.json: format_version .* is not supported"):
        parse(manifest_dict)


@pytest.mark.parametrize(
    "path",
    ["../outside", "/etc/passwd", "s3://other-bucket/shard", "shards/../../x", "C:/windows", "shards//x", "shards\\x"],
)
def test_shard_paths_that_leave_the_store_are_refused(manifest_dict, path):
    manifest_dict["shards"][0]["path"] = path
    with pytest.raises(ManifestError, match=r"shards\.0\.path"):
        parse(manifest_dict)


def test_file_outside_its_shard_is_refused(manifest_dict):
    shard = manifest_dict["shards"][0]
    shard["files"][0]["path"] = manifest_dict["shards"][1]["files"][0]["path"]
    with pytest.raises(ManifestError, match="lies outside its shard folder"):
        parse(manifest_dict)


def test_counts_that_disagree_are_refused(manifest_dict):
    manifest_dict["num_tokens"] += 1
    with pytest.raises(ManifestError, match="num_tokens .* != sum over shards"):
        parse(manifest_dict)


def test_duplicate_shard_ids_are_refused(manifest_dict):
    manifest_dict["shards"].append(manifest_dict["shards"][0])
    manifest_dict["num_samples"] += manifest_dict["shards"][0]["num_samples"]
    manifest_dict["num_tokens"] += manifest_dict["shards"][0]["num_tokens"]
    with pytest.raises(ManifestError, match="duplicate shard ids"):
        parse(manifest_dict)


def test_tampered_file_list_fails_the_checksum(manifest_dict):
    manifest_dict["shards"][0]["files"][0]["sha256"] = "0" * 64
    with pytest.raises(ManifestError, match="checksum does not match the file list"):
        parse(manifest_dict)


def test_unknown_keys_are_refused(manifest_dict):
    manifest_dict["surprise"] = 1
    with pytest.raises(ManifestError, match="surprise: Extra inputs are not permitted"):
        parse(manifest_dict)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=20))
def test_fuzzed_json_never_crashes_the_parser(value):
    try:
        manifest = parse_manifest(json.dumps(value))
    except ManifestError as err:
        assert "manifest.json" in str(err)  # a clean error naming the file, never a crash
    else:
        assert isinstance(manifest, hsstore.StoreManifest)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_fuzzed_bytes_never_crash_the_parser(data):
    with pytest.raises(ManifestError):
        parse_manifest(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_real_manifests_parse_or_fail_cleanly(manifest_dict, data):
    mutated = json.loads(json.dumps(manifest_dict))
    node = mutated
    keys = []
    while isinstance(node, (dict, list)) and node:
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        keys.append(key)
        if data.draw(st.booleans()) or not isinstance(node[key], (dict, list)):
            node[key] = data.draw(st.none() | st.integers(-5, 5) | st.text(max_size=5) | st.just("../x"))
            break
        node = node[key]
    try:
        parse_manifest(json.dumps(mutated))
    except ManifestError as err:
        assert "manifest.json" in str(err)
