"""direct_load.py: a plain safetensors checkpoint loaded straight into a model built on the device
equals ``from_pretrained``'s model (weights, buffers, tied heads, generation defaults, logits), and
anything it cannot load one to one is left to ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pipelines.extract.direct_load import load_direct
from pipelines.extract.target import load_target
from tests.support import models
from tests.support.paths import REFERENCE_TARGET


def assert_same_model(got: torch.nn.Module, want: torch.nn.Module, device: str = "cpu") -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype and torch.equal(got_state[name], tensor), name
    got_buffers, want_buffers = dict(got.named_buffers()), dict(want.named_buffers())
    assert got_buffers.keys() == want_buffers.keys()
    for name, tensor in want_buffers.items():  # the rotary tables are computed, not loaded
        assert torch.equal(got_buffers[name], tensor), name
    ids = torch.randint(0, 64, (2, 17), device=device)
    with torch.inference_mode():
        torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=0, atol=0)
    assert not got.training


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_reference_target_loads_as_from_pretrained_does(dtype: str) -> None:
    want = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    got = load_direct(REFERENCE_TARGET, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    assert got is not None
    assert_same_model(got, want)
    assert got.generation_config.eos_token_id == want.generation_config.eos_token_id
    assert got.config._name_or_path == str(REFERENCE_TARGET)
    # load_target takes this path, and freezes the weights as before.
    target = load_target(str(REFERENCE_TARGET), dtype=dtype, device="cpu")
    assert_same_model(target, want)
    assert not any(p.requires_grad for p in target.parameters())


def test_a_tied_head_is_tied_to_the_loaded_embeddings(tmp_path: Path) -> None:
    """A checkpoint that ties lm_head to the embeddings does not store it: it is tied, not left
    uninitialised."""
    models.tiny_qwen3(3, embed_scale=20.0, tie_word_embeddings=True).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    got = load_direct(tmp_path, dtype=torch.float32, device=torch.device("cpu"))
    assert got is not None and got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
    assert_same_model(got, AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval())


def test_what_it_cannot_load_one_to_one_is_left_to_from_pretrained(tmp_path: Path) -> None:
    models.tiny_qwen3(4).save_pretrained(tmp_path / "plain")
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    config = (tmp_path / "plain" / "config.json").read_text()

    def variant(name: str, changed: dict[str, torch.Tensor]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(config)
        save_file(changed, folder / "model.safetensors")
        return folder

    renamed = {("transformer." + k if k.startswith("model.") else k): v for k, v in tensors.items()}
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    reshaped = {**tensors, "model.norm.weight": torch.ones(7)}
    for folder in (variant("renamed", renamed), variant("missing", missing), variant("reshaped", reshaped)):
        assert load_direct(folder, dtype=torch.float32, device=torch.device("cpu")) is None, folder.name
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "config.json").write_text(config)
    torch.save(tensors, pickled / "pytorch_model.bin")
    assert load_direct(pickled, dtype=torch.float32, device=torch.device("cpu")) is None
    assert load_direct(tmp_path / "plain", dtype=torch.float32, device=torch.device("cpu")) is not None
    # load_target falls back to from_pretrained, which loads the missing norm as it always did
    # (initialised to ones, with its warning).
    fallback = load_target(str(tmp_path / "missing"), dtype="float32")
    assert_same_model(fallback, AutoModelForCausalLM.from_pretrained(tmp_path / "missing", dtype=torch.float32).eval())


@pytest.mark.gpu
def test_straight_to_the_gpu_equals_from_pretrained_there() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    want = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=torch.bfloat16, device_map="cuda").eval()
    got = load_direct(REFERENCE_TARGET, dtype=torch.bfloat16, device=torch.device("cuda"))
    assert got is not None and got.model.embed_tokens.weight.is_cuda
    assert_same_model(got, want, device="cuda")
