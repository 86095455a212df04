"""The TTT objective against a slow reference written step by step, plus mask and shift cases.

The reference recomputes everything per (depth, position) with plain loops: every key it attends
to is rebuilt from the token, the hidden state and the RoPE position it came from (no KV cache,
no SDPA, no batched masks), RoPE is written pair by pair, attention is an explicit softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.train.ttt import doc_remaining_from_ids, ttt_forward, ttt_unroll
from tests.support.models import build_draft


def ttt_draft(sliding_window: int | None = None, seed: int = 0, **overrides) -> Eagle3Draft:
    """A float64 draft small enough for the slow reference, with non-unit norms so that a swapped
    norm is caught (no vocabulary mapping: the reference scores target ids as they are)."""
    config = Eagle3Config(**{
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "vocab_size": 64,
        "draft_vocab_size": 40,
        "target_hidden_size": 24,
        "aux_layer_ids": [1, 2, 3],
        "sliding_window": sliding_window,
        "rope_theta": 500.0,
        **overrides,
    })
    return build_draft(config, seed, vocab_mapping=False, dtype=torch.float64)


# ---- the reference ---------------------------------------------------------------------------


def ref_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean() + eps)


def ref_fc_input(draft: Eagle3Draft, aux_KH: torch.Tensor) -> torch.Tensor:
    """The fc input at one position: the K aux states concatenated, each RMS-normed first with
    its own weight when the draft has EAGLE-3.1's fc_norm."""
    cfg = draft.config
    if draft.fc_norm is None:
        return aux_KH.reshape(-1)
    return torch.cat(
        [ref_rms(aux_KH[k], norm.weight, cfg.rms_norm_eps) for k, norm in enumerate(draft.fc_norm)]
    )


def ref_rope(x_NH: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Rotate each pair (k, k + d/2) by position * theta**(-2k/d), one pair at a time."""
    out = x_NH.clone()
    d = x_NH.shape[-1]
    for k in range(d // 2):
        angle = position * theta ** (-2 * k / d)
        a, b = x_NH[:, k], x_NH[:, k + d // 2]
        out[:, k] = a * math.cos(angle) - b * math.sin(angle)
        out[:, k + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def ref_qkv(draft: Eagle3Draft, token: int, h: torch.Tensor, position: int):
    cfg, layer = draft.config, draft.midlayer
    x = torch.cat(
        [
            ref_rms(
                draft.embed_tokens.weight[token], layer.input_layernorm.weight, cfg.rms_norm_eps
            ),
            ref_rms(h, layer.hidden_norm.weight, cfg.rms_norm_eps),
        ]
    )
    attn = layer.self_attn
    q = (attn.q_proj.weight @ x).view(cfg.num_attention_heads, cfg.head_dim)
    k = (attn.k_proj.weight @ x).view(cfg.num_key_value_heads, cfg.head_dim)
    v = (attn.v_proj.weight @ x).view(cfg.num_key_value_heads, cfg.head_dim)
    return ref_rope(q, position, cfg.rope_theta), ref_rope(k, position, cfg.rope_theta), v


def ref_layer(
    draft: Eagle3Draft, token: int, h: torch.Tensor, position: int, keys: list
) -> torch.Tensor:
    """One draft step for one query; ``keys`` lists (token, h, position) of every visible key,
    each recomputed from scratch."""
    cfg, layer = draft.config, draft.midlayer
    q, _, _ = ref_qkv(draft, token, h, position)
    kvs = [ref_qkv(draft, *key)[1:] for key in keys]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    heads = []
    for head in range(cfg.num_attention_heads):
        scores = torch.stack([q[head] @ k[head // group] for k, _ in kvs]) / math.sqrt(cfg.head_dim)
        weights = torch.softmax(scores, dim=0)
        heads.append(sum(w * v[head // group] for w, (_, v) in zip(weights, kvs, strict=True)))
    h2 = h + layer.self_attn.o_proj.weight @ torch.cat(heads)
    mlp_in = ref_rms(h2, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
    mlp = layer.mlp
    act = torch.nn.functional.silu(mlp.gate_proj.weight @ mlp_in) * (mlp.up_proj.weight @ mlp_in)
    return h2 + mlp.down_proj.weight @ act


def reference_ttt(draft, aux, ids, pos, loss_mask, teacher, valid, docs, ttt_length, decay=0.8):
    cfg = draft.config
    B, T = ids.shape
    window = cfg.sliding_window
    step_sums = [0.0] * ttt_length
    step_counts = [0] * ttt_length
    step_correct = [0] * ttt_length
    hidden_ref = {}
    for b in range(B):
        doc = docs[b].tolist()
        remaining = [
            sum(1 for u in range(t + 1, T) if all(doc[w] == doc[t] for w in range(t, u + 1)))
            for t in range(T)
        ]
        fused = [draft.fc.weight @ ref_fc_input(draft, aux[b, t]) for t in range(T)]
        h = {}  # (depth, t) -> hidden output
        for depth in range(ttt_length):
            for t in range(T):
                if remaining[t] < 1 + depth:  # its input token t+1+depth is in another document
                    continue
                h_in = fused[t] if depth == 0 else h[(depth - 1, t)]
                query_pos = int(pos[b, t]) + depth
                # The window ends at the drafted token ("position") or at the context's last
                # position t, the chain's keys coming on top ("context", as eagle-harness serves).
                window_end = query_pos if cfg.window_mode == "position" else int(pos[b, t])
                keys = []
                for s in range(t + 1):  # depth-0 keys of the same document
                    if doc[s] != doc[t]:
                        continue
                    if window is not None and window_end - int(pos[b, s]) >= window:
                        continue
                    keys.append((int(ids[b, s + 1]), fused[s], int(pos[b, s])))
                for j in range(1, depth + 1):  # this position's own drafted keys
                    keys.append((int(ids[b, t + 1 + j]), h[(j - 1, t)], int(pos[b, t]) + j))
                out = ref_layer(draft, int(ids[b, t + 1 + depth]), h_in, query_pos, keys)
                normed = ref_rms(out, draft.norm.weight, cfg.rms_norm_eps)
                # EAGLE-3.1's norm_output: the next depth gets what lm_head reads.
                h[(depth, t)] = normed if cfg.norm_output else out
                hidden_ref[(b, depth, t)] = h[(depth, t)]
                # Score the prediction of token t+2+depth against the teacher at t+1+depth.
                j = t + 2 + depth
                if remaining[t] < 2 + depth or not loss_mask[b, j] or not valid[b, j - 1]:
                    continue
                logits = draft.lm_head.weight @ normed
                p = teacher[b, j - 1]
                step_sums[depth] = step_sums[depth] - (p * torch.log_softmax(logits, 0)).sum()
                step_counts[depth] += 1
                step_correct[depth] += int(logits.argmax() == p.argmax())
    losses = [s / max(c, 1) for s, c in zip(step_sums, step_counts, strict=True)]
    total = sum(decay**i * loss for i, loss in enumerate(losses))
    return total, losses, step_counts, step_correct, hidden_ref


# ---- inputs ----------------------------------------------------------------------------------


def packed_batch(draft: Eagle3Draft, doc_lengths: list[list[int]], seed: int = 1):
    """Random inputs for rows of packed documents; position ids restart per document."""
    gen = torch.Generator().manual_seed(seed)
    cfg = draft.config
    T = max(sum(row) for row in doc_lengths)
    B = len(doc_lengths)
    docs = torch.full((B, T), -1, dtype=torch.long)  # -1: padding
    pos = torch.zeros((B, T), dtype=torch.long)
    for b, row in enumerate(doc_lengths):
        start = 0
        for d, length in enumerate(row):
            docs[b, start : start + length] = d
            pos[b, start : start + length] = torch.arange(length)
            start += length
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    aux = torch.randn(
        B, T, cfg.num_aux_layers, cfg.target_hidden_size, generator=gen, dtype=torch.float64
    )
    loss_mask = (torch.rand(B, T, generator=gen) < 0.8) & (docs >= 0)
    teacher = torch.softmax(
        3 * torch.randn(B, T, cfg.draft_vocab_size, generator=gen, dtype=torch.float64), -1
    )
    valid = torch.rand(B, T, generator=gen) < 0.85
    return aux, ids, pos, loss_mask, teacher, valid, docs


@pytest.mark.parametrize(
    ("window", "doc_lengths", "ttt_length", "options"),
    [
        (None, [[13], [5, 8]], 3, {}),
        (None, [[2, 1, 7, 3], [6, 4]], 4, {}),  # documents shorter than the unroll
        # the window cuts depth-0 keys: the W most recent context keys at every depth (served)
        (4, [[12], [9, 3]], 3, {"window_mode": "context"}),
        # ... or W positions back from the drafted token: it cuts more at deeper steps
        (4, [[12], [9, 3]], 3, {"window_mode": "position"}),
        # EAGLE-3.1: per-aux-layer norms before fc, the normed output fed to the next depth
        (None, [[13], [5, 8]], 3, {"fc_norm": True, "norm_output": True}),
        (4, [[2, 1, 7, 3], [6, 4]], 4, {"fc_norm": True, "norm_output": True}),
    ],
)
def test_ttt_equals_step_by_step_reference(window, doc_lengths, ttt_length, options):
    draft = ttt_draft(window, **options)
    aux, ids, pos, loss_mask, teacher, valid, docs = packed_batch(draft, doc_lengths)
    out = ttt_forward(draft, aux, ids, pos, loss_mask, teacher, valid, docs, ttt_length=ttt_length)
    total, losses, counts, correct, hidden_ref = reference_ttt(
        draft, aux, ids, pos, loss_mask, teacher, valid, docs, ttt_length
    )
    assert [int(c) for c in out.step_counts] == counts
    assert sum(counts[1:]) > 0, "the case must score deeper steps"
    assert [int(c) for c in out.step_correct] == correct
    for got, want in zip(out.step_losses, losses, strict=True):
        torch.testing.assert_close(
            got.double(), torch.as_tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9
        )
    torch.testing.assert_close(
        out.loss.double(), torch.as_tensor(total, dtype=torch.float64), rtol=1e-9, atol=1e-9
    )
    for (b, depth, t), h in hidden_ref.items():
        torch.testing.assert_close(out.hidden_per_step[depth][b, t], h, rtol=1e-9, atol=1e-9)
    # Gradients flow through the unroll the same way (fed-back hidden states are not detached).
    grad = torch.autograd.grad(out.loss, draft.fc.weight)[0]
    draft.zero_grad()
    ref_grad = torch.autograd.grad(total, draft.fc.weight)[0]
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-9)


def test_documents_do_not_see_each_other():
    draft = ttt_draft()
    aux, ids, pos, _, _, _, docs = packed_batch(draft, [[6, 7]])
    first = ttt_unroll(draft, aux, ids, pos, docs, ttt_length=3)
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[:, 6:] = torch.randn_like(aux2[:, 6:])
    ids2[:, 7:] = (ids2[:, 7:] + 1) % draft.config.vocab_size  # token 6 feeds position 5's input
    second = ttt_unroll(draft, aux2, ids2, pos, docs, ttt_length=3)
    for depth, (a, b) in enumerate(zip(first, second, strict=True)):
        # Position t of document 0 at depth i reads token t+1+i, which must stay inside it.
        last = 6 - 1 - depth
        torch.testing.assert_close(a[:, :last], b[:, :last], rtol=0, atol=0)
        assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_single_document_counts_shift_by_one_per_step():
    draft = ttt_draft()
    T = 10
    aux, ids, pos, _, teacher, _, docs = packed_batch(draft, [[T]])
    ones = torch.ones(1, T, dtype=torch.bool)
    out = ttt_forward(draft, aux, ids, pos, ones, teacher, ones, docs, ttt_length=4)
    # Depth i at t predicts token t+2+i, which exists for t < T-2-i.
    assert [int(c) for c in out.step_counts] == [T - 2 - i for i in range(4)]
    assert [m.nonzero()[:, 1].max().item() for m in out.step_masks] == [T - 3 - i for i in range(4)]


def test_loss_mask_and_teacher_validity_shift_with_depth():
    draft = ttt_draft()
    T = 9
    aux, ids, pos, _, teacher, _, docs = packed_batch(draft, [[T]])
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, 6] = True  # only token 6 is learnable
    valid = torch.ones(1, T, dtype=torch.bool)
    out = ttt_forward(draft, aux, ids, pos, loss_mask, teacher, valid, docs, ttt_length=3)
    # Token 6 is predicted from position 6-2-i at depth i.
    assert [m[0].nonzero().flatten().tolist() for m in out.step_masks] == [[4], [3], [2]]
    valid[0, 5] = False  # the teacher of token 6 lives at position 5
    out = ttt_forward(draft, aux, ids, pos, loss_mask, teacher, valid, docs, ttt_length=3)
    assert [int(c) for c in out.step_counts] == [0, 0, 0]
    assert out.loss.item() == 0.0 and not torch.isnan(out.loss)


def test_doc_remaining_from_ids():
    docs = torch.tensor([[0, 0, 0, 1, 2, 2, -1, -1]])
    assert doc_remaining_from_ids(docs).tolist() == [[2, 1, 0, 0, 1, 0, 1, 0]]


def test_window_shorter_than_unroll_is_refused():
    draft = ttt_draft(sliding_window=2)
    aux, ids, pos, loss_mask, teacher, valid, docs = packed_batch(draft, [[6]])
    with pytest.raises(ValueError, match="sliding_window=2 is shorter than ttt_length=3"):
        ttt_forward(draft, aux, ids, pos, loss_mask, teacher, valid, docs, ttt_length=3)
