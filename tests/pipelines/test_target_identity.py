"""Target identity: stable hashes of config, weights, tokenizer and chat template."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hsstore.aux_layers import default_aux_layer_ids
from pipelines.target_identity import (
    chat_template_sha256,
    config_sha256,
    read_chat_template,
    sha256_file,
    target_identity,
    tokenizer_sha256,
)
from tests.support.paths import REFERENCE_TARGET


@pytest.fixture()
def target_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "target"
    shutil.copytree(REFERENCE_TARGET, copy)
    return copy


def test_reference_target_identity() -> None:
    identity = target_identity(REFERENCE_TARGET)
    assert identity["architecture"] == "Qwen3ForCausalLM"
    assert identity["model_type"] == "qwen3"
    assert (identity["num_hidden_layers"], identity["hidden_size"], identity["vocab_size"]) == (8, 384, 8192)
    assert sorted(identity["weight_files"]) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert identity == target_identity(REFERENCE_TARGET), "pure: the same directory hashes the same"
    assert default_aux_layer_ids(8) == [2, 4, 5]


def test_what_changes_the_identity(target_copy: Path) -> None:
    before = target_identity(target_copy)
    config = json.loads((target_copy / "config.json").read_text())
    # Re-saving with another transformers version (and reformatting) is the same model...
    config["transformers_version"] = "9.9.9"
    (target_copy / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))
    assert target_identity(target_copy)["config_sha256"] == before["config_sha256"]
    # ...another rope theta is not.
    config["rope_theta"] = 20000.0
    (target_copy / "config.json").write_text(json.dumps(config))
    assert target_identity(target_copy)["config_sha256"] != before["config_sha256"]
    weights = target_copy / "model-00002-of-00003.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    after = target_identity(target_copy)["weight_files"]
    changed = [name for name in after if after[name] != before["weight_files"][name]]
    assert changed == ["model-00002-of-00003.safetensors"]


def test_tokenizer_and_template_hashes_are_independent(target_copy: Path) -> None:
    tokenizer_hash = tokenizer_sha256(target_copy)
    template = read_chat_template(target_copy)
    assert template is not None and "{% generation %}" in template
    template_hash = chat_template_sha256(template)
    (target_copy / "chat_template.jinja").write_text(template.replace("assistant", "bot"))
    assert tokenizer_sha256(target_copy) == tokenizer_hash
    assert chat_template_sha256(read_chat_template(target_copy)) != template_hash
    # A template kept inside tokenizer_config.json is found there, and still not in the tokenizer hash.
    (target_copy / "chat_template.jinja").unlink()
    config = json.loads((target_copy / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (target_copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_template_sha256(read_chat_template(target_copy)) == template_hash
    assert tokenizer_sha256(target_copy) == tokenizer_hash
    assert chat_template_sha256(None) is None


def test_hub_cache_blob_names_are_trusted(tmp_path: Path) -> None:
    """A file linked into the HF cache is not re-read: its blob name is its sha256."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    real = blobs / ("ab" * 32)
    real.write_bytes(b"not really hashing to that")
    link = tmp_path / "model.safetensors"
    os.symlink(real, link)
    assert sha256_file(link) == "ab" * 32
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"abc")
    assert sha256_file(plain) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config.json does not exist: the target must be"):
        target_identity(tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 10}')
    with pytest.raises(FileNotFoundError, match=r"holds no \*.safetensors"):
        target_identity(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds none of the tokenizer files"):
        tokenizer_sha256(tmp_path)
    assert config_sha256({"a": 1, "transformers_version": "1"}) == config_sha256({"a": 1})
    assert default_aux_layer_ids(4) == [1, 2] and default_aux_layer_ids(1) == [0, 1]


def test_large_file_digests_are_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """A weight file's sha256 is cached by path, size, mtime and inode: a rerun does not rehash 16+ GB,
    and any change to the file (here its size and mtime) rehashes it."""
    import hashlib
    import os

    from pipelines import target_identity

    monkeypatch.setenv("HSSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(target_identity, "HASH_CACHE_MIN_BYTES", 1)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 1000)
    first = target_identity.sha256_file(weights)
    assert first == hashlib.sha256(b"a" * 1000).hexdigest()
    assert (tmp_path / "cache" / "file-sha256.json").exists()
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(target_identity.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    assert target_identity.sha256_file(weights) == first and calls == []  # from the cache
    weights.write_bytes(b"b" * 1001)
    os.utime(weights, ns=(1, 1))
    assert target_identity.sha256_file(weights) == real(b"b" * 1001).hexdigest() and calls == [1]
