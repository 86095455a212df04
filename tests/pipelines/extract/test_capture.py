"""Hook capture equals a plain transformers forward, batched or not; padding never leaks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.extract.batching import Batch, collate
from pipelines.extract.capture import (
    MASK_FREE_MODEL_TYPES,
    HiddenStateCapture,
    UnsupportedModelError,
    find_decoder_parts,
    resolve_pass_attention_mask,
)
from pipelines.extract.target import load_target


def reference_forward(model: torch.nn.Module, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
    """hidden_states of an unbatched, unpadded forward of the whole causal LM."""
    with torch.inference_mode():
        out = model(input_ids=torch.from_numpy(ids[None].astype(np.int64)), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-token relative L2 error."""
    actual_TD = actual.float().reshape(actual.shape[0], -1)
    expected_TD = expected.float().reshape(expected.shape[0], -1)
    error_T = (actual_TD - expected_TD).norm(dim=-1) / expected_TD.norm(dim=-1).clamp_min(1e-6)
    return float(error_T.max())


def batch_of(token_ids: list[np.ndarray]) -> Batch:
    longest = max(len(t) for t in token_ids)
    return Batch(tuple(range(len(token_ids))), longest + 3, sum(len(t) for t in token_ids))


def random_sequences(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8192, n).astype(np.int32) for n in lengths]


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_tiny_models_match_output_hidden_states(fixture: str, request: pytest.FixtureRequest) -> None:
    target: Path = request.getfixturevalue(fixture)
    model = load_target(str(target), dtype="float32", attn_implementation="sdpa")
    num_layers = model.config.num_hidden_layers
    aux_ids = [0, 2, num_layers]  # embeddings, a middle layer, one past the last (= final norm)
    token_ids = random_sequences([5, 17, 1, 11])
    input_ids, attention_mask = collate(token_ids, batch_of(token_ids), pad_token_id=0)
    with HiddenStateCapture(model, aux_ids, topk_k=5) as capture:
        features = capture(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
    assert features["aux_hidden_states"].shape == (34, 3, 64)
    offset = 0
    for ids in token_ids:
        hidden = reference_forward(model, ids)
        # transformers' last hidden state is the post-norm one: what lm_head multiplies.
        logits = model.lm_head(hidden[-1])
        rows = slice(offset, offset + len(ids))
        for k, layer_id in enumerate(aux_ids):
            torch.testing.assert_close(features["aux_hidden_states"][rows, k], hidden[layer_id], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(features["final_hidden_state"][rows], hidden[num_layers], rtol=1e-5, atol=1e-5)
        top = logits.float().topk(5, dim=-1)
        torch.testing.assert_close(features["topk_logits"][rows], top.values, rtol=1e-5, atol=1e-5)
        assert torch.equal(features["topk_ids"][rows], top.indices.to(torch.int32))
        offset += len(ids)
    assert offset == features["final_hidden_state"].shape[0]


def test_final_state_is_post_norm(tiny_qwen3: Path) -> None:
    """The stored final state is norm(last layer output), not the raw residual stream."""
    model = load_target(str(tiny_qwen3), dtype="float32")
    ids = random_sequences([9])[0]
    captured = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.setdefault("pre", out))
    with HiddenStateCapture(model, [1]) as capture:
        features = capture(torch.from_numpy(ids[None].astype(np.int64)), torch.ones(1, 9, dtype=torch.int64))
    handle.remove()
    pre_norm = captured["pre"][0] if isinstance(captured["pre"], tuple) else captured["pre"]
    torch.testing.assert_close(features["final_hidden_state"], model.model.norm(pre_norm)[0])
    assert not torch.allclose(features["final_hidden_state"], pre_norm[0], atol=1e-3)


def test_reference_target_batched_equals_unbatched(reference_target: Path) -> None:
    """The real target: in float32 batched == unbatched == output_hidden_states; in its own bf16,
    batching moves the features no further from the float32 truth than bf16 itself does."""
    token_ids = random_sequences([40, 7, 23], seed=3)
    input_ids, attention_mask = collate(token_ids, batch_of(token_ids), pad_token_id=0)
    model32 = load_target(str(reference_target), dtype="float32")
    model16 = load_target(str(reference_target), dtype="bfloat16")
    with HiddenStateCapture(model32, [2, 4, 5]) as capture32, HiddenStateCapture(model16, [2, 4, 5]) as capture16:
        batched32 = capture32(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        batched16 = capture16(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        offset = 0
        for ids in token_ids:
            rows = slice(offset, offset + len(ids))
            one_BT = torch.ones(1, len(ids), dtype=torch.int64)
            ids_BT = torch.from_numpy(ids[None].astype(np.int64))
            alone32, alone16 = capture32(ids_BT, one_BT), capture16(ids_BT, one_BT)
            hidden = reference_forward(model32, ids)
            for k, layer_id in enumerate([2, 4, 5]):
                torch.testing.assert_close(batched32["aux_hidden_states"][rows, k], hidden[layer_id], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(batched32["final_hidden_state"][rows], hidden[-1], rtol=1e-5, atol=1e-5)
            for name in ("aux_hidden_states", "final_hidden_state"):
                torch.testing.assert_close(alone32[name], batched32[name][rows], rtol=1e-5, atol=1e-5)
                bf16_error = relative_error(alone16[name], alone32[name])
                assert bf16_error < 2e-2, f"{name}: bf16 vs float32 {bf16_error:.2e}"
                assert relative_error(batched16[name][rows], alone32[name]) < 1.5 * bf16_error + 1e-3
            offset += len(ids)


def tiny_model_of(model_type: str) -> torch.nn.Module:
    """A random 3-layer model of ``model_type``, in memory, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra: dict = {"qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "decoder_sparse_step": 1, "mlp_only_layers": []},
                   "mistral": {"sliding_window": 8}}.get(model_type, {})
    config = AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20.0)
    return model.eval()


@pytest.mark.parametrize("model_type", sorted(MASK_FREE_MODEL_TYPES))
def test_attention_mask_is_optional_with_right_padding(model_type: str) -> None:
    """Every architecture the ``auto`` default runs without a mask: right padding + causal attention
    give the valid tokens the same features with and without it (Mistral with a sliding window
    shorter than the rows, Qwen3-MoE with per-token routing)."""
    model = tiny_model_of(model_type)
    assert not resolve_pass_attention_mask("auto", model.config.model_type)
    token_ids = [t % 512 for t in random_sequences([13, 3, 20, 8], seed=5)]
    input_ids, attention_mask = collate(token_ids, batch_of(token_ids), pad_token_id=7)
    outputs = []
    for pass_mask in (True, False):
        with HiddenStateCapture(model, [1, 3], pass_attention_mask=pass_mask) as capture:
            outputs.append(capture(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)))
    for name in ("aux_hidden_states", "final_hidden_state"):
        torch.testing.assert_close(outputs[0][name], outputs[1][name], rtol=1e-5, atol=1e-5)
    # And both equal each row run alone (the truth the mask is meant to protect).
    offset = 0
    for ids in token_ids:
        alone = reference_forward(model, ids)
        torch.testing.assert_close(outputs[1]["final_hidden_state"][offset : offset + len(ids)], alone[-1], rtol=1e-5, atol=1e-5)
        offset += len(ids)


def test_reference_target_needs_no_mask(reference_target: Path) -> None:
    """The reference target (Qwen3) in its own bf16: the default (no mask) gives the masked features."""
    model = load_target(str(reference_target), dtype="bfloat16")
    assert not resolve_pass_attention_mask("auto", model.config.model_type)
    token_ids = random_sequences([40, 7, 23, 31], seed=3)
    input_ids, attention_mask = collate(token_ids, batch_of(token_ids), pad_token_id=0)
    outputs = []
    for pass_mask in (True, False):
        with HiddenStateCapture(model, [2, 4, 5], pass_attention_mask=pass_mask) as capture:
            outputs.append(capture(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)))
    for name in ("aux_hidden_states", "final_hidden_state"):
        # bf16 kernels may order sums differently with and without a mask: within bf16's rounding.
        assert relative_error(outputs[1][name], outputs[0][name]) < 1e-2


def test_unknown_architectures_keep_the_mask() -> None:
    assert resolve_pass_attention_mask("auto", "gemma3") is True
    assert resolve_pass_attention_mask("auto", None) is True
    assert resolve_pass_attention_mask(True, "qwen3") is True
    assert resolve_pass_attention_mask(False, "gemma3") is False
    with pytest.raises(ValueError, match="true, false or auto"):
        resolve_pass_attention_mask("sometimes", "qwen3")


def test_padding_values_do_not_leak(tiny_llama: Path) -> None:
    """Whatever sits in the padded positions, the valid tokens' features are the same."""
    model = load_target(str(tiny_llama), dtype="float32")
    token_ids = random_sequences([12, 4])
    batch = batch_of(token_ids)
    with HiddenStateCapture(model, [1, 3]) as capture:
        outputs = []
        for pad in (0, 4242):
            input_ids, attention_mask = collate(token_ids, batch, pad_token_id=pad)
            outputs.append(capture(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)))
    torch.testing.assert_close(outputs[0]["aux_hidden_states"], outputs[1]["aux_hidden_states"], rtol=1e-5, atol=1e-5)


def test_out_of_range_layer_and_unsupported_model(tiny_qwen3: Path) -> None:
    model = load_target(str(tiny_qwen3), dtype="float32")
    with pytest.raises(ValueError, match=r"aux_layer_ids \[5\] out of range: this model has 4 decoder layers"):
        HiddenStateCapture(model, [0, 5])
    with pytest.raises(UnsupportedModelError, match="cannot find decoder layers"):
        find_decoder_parts(torch.nn.Linear(2, 2))


def test_hooks_live_only_during_a_call(tiny_qwen3: Path) -> None:
    """Between calls the model is untouched: a bare forward keeps no captured tensors."""
    model = load_target(str(tiny_qwen3), dtype="float32")
    capture = HiddenStateCapture(model, [1, 2])
    capture(torch.ones(1, 4, dtype=torch.int64), torch.ones(1, 4, dtype=torch.int64))
    hooked = [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == [] and capture._captured == {}
