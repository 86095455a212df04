"""The checkpoint reader (pinned pieces to the device) and the load path built on it: the same
tensors, buffers and outputs as ``from_pretrained`` reading the files itself."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipelines.extract.checkpoint_reader import UnsupportedCheckpoint, read_checkpoint, read_header
from pipelines.extract.target import load_target
from tests.support import models


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _expected(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _files(directory):
        tensors.update(load_file(path))
    return tensors


def _assert_same_model(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    actual_state, expected_state = actual.state_dict(), expected.state_dict()
    assert list(actual_state) == list(expected_state)
    for name, tensor in expected_state.items():
        assert actual_state[name].dtype == tensor.dtype, name
        assert actual_state[name].device == tensor.device, name
        assert torch.equal(actual_state[name], tensor), name
    actual_buffers = dict(actual.named_buffers())
    for name, buffer in expected.named_buffers():  # the rotary tables, computed at construction
        assert actual_buffers[name].device == buffer.device, name
        assert torch.equal(actual_buffers[name], buffer), name


@pytest.mark.parametrize(("piece_bytes", "threads"), [(1000, 3), (1 << 20, 2), (64 << 20, 1)])
def test_pieces_smaller_and_larger_than_tensors_read_every_byte(
    reference_target: Path, piece_bytes: int, threads: int
) -> None:
    tensors = read_checkpoint(_files(reference_target), torch.device("cpu"), piece_bytes=piece_bytes, threads=threads)
    expected = _expected(reference_target)
    assert sorted(tensors) == sorted(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and tensors[name].shape == tensor.shape, name
        assert torch.equal(tensors[name], tensor), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_reader_loads_the_reference_target_as_from_pretrained_does(reference_target: Path, dtype: str) -> None:
    expected = load_target(str(reference_target), dtype=dtype, weights_loader="transformers")
    actual = load_target(str(reference_target), dtype=dtype)
    _assert_same_model(actual, expected)
    assert actual.config._name_or_path == str(reference_target)
    assert actual.generation_config.eos_token_id == expected.generation_config.eos_token_id
    ids = torch.tensor([[1, 17, 230, 5, 9]])
    assert torch.equal(actual(ids).logits, expected(ids).logits)


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    model = models.tiny_qwen3(3, tie_word_embeddings=True, head_dim=16)
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in _expected(tmp_path)  # the file holds the embedding once
    actual = load_target(str(tmp_path), dtype="float32")
    _assert_same_model(actual, load_target(str(tmp_path), dtype="float32", weights_loader="transformers"))
    assert actual.lm_head.weight.data_ptr() == actual.get_input_embeddings().weight.data_ptr()


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


def test_a_header_it_cannot_read_is_named(tmp_path: Path) -> None:
    model = models.tiny_qwen3(4, head_dim=16)
    model.save_pretrained(tmp_path)
    (path,) = _files(tmp_path)
    first = read_header(path)[0].name

    def to_complex(header: dict) -> None:
        header[first]["dtype"] = "C64"  # a name safetensors' readers will not meet here

    _rewrite_header(path, to_complex)
    with pytest.raises(UnsupportedCheckpoint, match=rf"{path}.*{first}.*C64"):
        read_header(path)
    with pytest.raises(UnsupportedCheckpoint, match="not JSON"):
        path.write_bytes(struct.pack("<Q", 4) + b"{no}")
        read_header(path)


def test_a_file_shorter_than_its_header_says_is_named(tmp_path: Path) -> None:
    model = models.tiny_qwen3(5, head_dim=16)
    model.save_pretrained(tmp_path)
    (path,) = _files(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UnsupportedCheckpoint, match=rf"{path}: ends before byte"):
        read_checkpoint([path], torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_reader_fills_cuda_tensors_and_loads_as_from_pretrained_does(reference_target: Path) -> None:
    device = torch.device("cuda")
    tensors = read_checkpoint(_files(reference_target), device, piece_bytes=1 << 20, threads=4)
    for name, tensor in _expected(reference_target).items():
        assert tensors[name].device.type == "cuda"
        assert torch.equal(tensors[name].cpu(), tensor), name
    expected = load_target(str(reference_target), dtype="bfloat16", device=device, weights_loader="transformers")
    actual = load_target(str(reference_target), dtype="bfloat16", device=device)
    _assert_same_model(actual, expected)
    ids = torch.tensor([[1, 17, 230, 5, 9]], device=device)
    assert torch.equal(actual(ids).logits, expected(ids).logits)


def test_a_checkpoint_without_safetensors_loads_through_from_pretrained(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = models.tiny_qwen3(6, head_dim=16)
    model.save_pretrained(tmp_path)
    for path in _files(tmp_path):
        path.unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with caplog.at_level("INFO", logger="pipelines.extract.target"):
        loaded = load_target(str(tmp_path), dtype="float32")
    assert "through from_pretrained" in caplog.text
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
