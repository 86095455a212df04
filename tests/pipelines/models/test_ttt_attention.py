"""The fused (flex) and per-document (segmented) TTT attention equal the eager reference at every
depth.

On the CPU flex_attention runs its eager reference path, forward only (it has no CPU backward);
the ``gpu`` tests compile it and compare gradients too. Shapes cross 128-token block boundaries so
that full, partial and absent blocks, padding to a block multiple and the windowed block bounds
are all exercised."""

from __future__ import annotations

import pytest
import torch

from pipelines.models.ttt_attention import (
    EagerTTTAttention,
    FlexTTTAttention,
    SegmentedTTTAttention,
    make_ttt_attention,
    run_ids,
)

CASES = [
    # (doc lengths per row, sliding window, ttt length, window mode)
    ([[300]], None, 3, "context"),
    ([[100, 157, 43], [5, 295]], None, 4, "context"),
    ([[260, 40], [128, 128, 44]], 64, 3, "context"),
    ([[260, 40], [128, 128, 44]], 64, 3, "position"),
    ([[37]], None, 2, "context"),  # shorter than one block
    ([[200, 100]], 150, 3, "context"),
    ([[200, 100]], 128, 4, "position"),  # the window ends on a block boundary at depth 0 only
    ([[100, 50], [40]], None, 3, "context"),  # a shorter row: its padding is one more run
]


def packed(doc_lengths: list[list[int]], device: str = "cpu"):
    T = max(sum(row) for row in doc_lengths)
    docs = torch.full((len(doc_lengths), T), -1, dtype=torch.long)
    pos = torch.zeros_like(docs)
    for b, row in enumerate(doc_lengths):
        start = 0
        for d, length in enumerate(row):
            docs[b, start : start + length] = d
            pos[b, start : start + length] = torch.arange(length)
            start += length
    return docs.to(device), pos.to(device)


def qkv(B: int, T: int, depth_count: int, device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 16
    out = []
    for _ in range(depth_count):
        q = torch.randn(B, heads, T, dim, generator=gen, dtype=torch.float64)
        k = torch.randn(B, kv_heads, T, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(B, kv_heads, T, dim, generator=gen, dtype=torch.float64)
        out.append(tuple(x.to(device=device, dtype=dtype) for x in (q, k, v)))
    return out


def unroll(attention, inputs):
    return [attention.attend(q, k, v, depth) for depth, (q, k, v) in enumerate(inputs)]


@pytest.mark.parametrize(("doc_lengths", "window", "ttt_length", "mode"), CASES)
def test_flex_equals_eager_forward_on_cpu(doc_lengths, window, ttt_length, mode):
    docs, pos = packed(doc_lengths)
    inputs = qkv(docs.shape[0], docs.shape[1], ttt_length, "cpu", torch.float32)
    want = unroll(EagerTTTAttention(docs, pos, window, mode), inputs)
    got = unroll(FlexTTTAttention(docs, pos, window, ttt_length, compiled=False, window_mode=mode), inputs)
    for depth, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"depth {depth}")


def forward_and_grads(attention, base):
    inputs = [tuple(x.clone().requires_grad_(True) for x in depth) for depth in base]
    outs = unroll(attention, inputs)
    loss = sum((o * (i + 1)).square().mean() for i, o in enumerate(outs))
    loss.backward()
    return outs, [[x.grad for x in depth] for depth in inputs]


@pytest.mark.parametrize(("doc_lengths", "window", "ttt_length", "mode"), CASES)
def test_segmented_equals_eager_forward_and_backward(doc_lengths, window, ttt_length, mode):
    docs, pos = packed(doc_lengths)
    base = qkv(docs.shape[0], docs.shape[1], ttt_length, "cpu", torch.float64)
    want_out, want_grads = forward_and_grads(EagerTTTAttention(docs, pos, window, mode), base)
    got_out, got_grads = forward_and_grads(SegmentedTTTAttention(docs, pos, window, mode), base)
    for depth, (g, w) in enumerate(zip(got_out, want_out, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"depth {depth}")
    for depth, (gd, wd) in enumerate(zip(got_grads, want_grads, strict=True)):
        for name, g, w in zip("qkv", gd, wd, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"d{name} at depth {depth}")


def test_segmented_splits_rows_at_document_runs_and_auto_picks_it_on_the_cpu():
    docs, pos = packed([[100, 157, 43], [5, 295]])
    attention = make_ttt_attention("auto", docs, pos, None, ttt_length=2)
    assert isinstance(attention, SegmentedTTTAttention)
    assert attention.segments == [[(0, 100), (100, 257), (257, 300)], [(0, 5), (5, 300)]]
    with pytest.raises(ValueError, match="out of order"):
        q, k, v = qkv(2, 300, 1, "cpu", torch.float32)[0]
        attention.attend(q, k, v, depth=1)


def listed_blocks(num: torch.Tensor, indices: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Bool [B, q blocks, kv blocks] from a BlockMask's (count, indices) listing."""
    dense = torch.zeros(shape, dtype=torch.bool)
    B, nq, _ = shape
    for b in range(B):
        for qb in range(nq):
            dense[b, qb, indices[b, 0, qb, : num[b, 0, qb]].long()] = True
    return dense


@pytest.mark.parametrize(("doc_lengths", "window", "ttt_length", "mode"), CASES)
def test_block_lists_cover_every_visible_pair_and_full_blocks_need_no_mask(
    doc_lengths, window, ttt_length, mode
):
    """flex's CPU path ignores the block lists, so check them against the element mask here."""
    docs, pos = packed(doc_lengths)
    attention = FlexTTTAttention(docs, pos, window, ttt_length, compiled=False, window_mode=mode)
    B, Tp, L = docs.shape[0], attention.Tp, ttt_length
    for depth in range(ttt_length):
        mask = attention.block_mask(depth)
        b = torch.arange(B)[:, None, None]
        q = torch.arange(Tp)[None, :, None]
        kv = torch.arange(L * Tp)[None, None, :]
        allowed = mask.mask_mod(b, 0, q, kv)  # [B, Tp, L*Tp]
        blocks = allowed.view(B, Tp // 128, 128, L * Tp // 128, 128)
        any_pair, all_pairs = blocks.any(4).any(2), blocks.all(4).all(2)
        shape = tuple(any_pair.shape)
        partial = listed_blocks(mask.kv_num_blocks, mask.kv_indices, shape)
        full = listed_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, shape)
        assert not (partial & full).any()
        assert ((partial | full) >= any_pair).all(), f"depth {depth}: a visible pair is skipped"
        assert (all_pairs >= full).all(), f"depth {depth}: a full block has masked pairs"
        if window is None:  # and nothing is computed that no query sees
            assert ((partial | full) == any_pair).all()
        # The element mask itself is the eager reference's (depth-0 keys + own diagonal keys).
        T = docs.shape[1]
        from pipelines.models.ttt_attention import ttt_base_mask

        want_base = ttt_base_mask(docs, pos, depth, window, mode)
        assert torch.equal(allowed[:, :T, :T], want_base)
        for j in range(1, L):
            own = allowed[:, :T, j * Tp : j * Tp + T]
            assert torch.equal(own, torch.eye(T, dtype=torch.bool).expand(B, T, T) & (j <= depth))


def test_block_mask_skips_what_no_query_sees():
    """Two 256-token documents: the second's queries skip the first's blocks, so the depth-0 part
    has 3 + 3 (full + partial per document) blocks, not the 10 of a causal mask over 512."""
    docs, pos = packed([[256, 256]])
    attention = FlexTTTAttention(docs, pos, None, ttt_length=2, compiled=False)
    mask = attention.block_mask(depth=0)
    partial = int(mask.kv_num_blocks.sum())
    full = int(mask.full_kv_num_blocks.sum())
    assert (partial, full) == (4, 2)  # diagonal blocks are partial; one full block per document
    mask1 = attention.block_mask(depth=1)
    assert int(mask1.kv_num_blocks.sum()) == 4 + 4  # plus one own-key diagonal block per q block


def test_run_ids_number_contiguous_documents():
    docs = torch.tensor([[5, 5, 7, 7, 7, -1], [0, 1, 1, 0, 0, 0]])
    assert run_ids(docs).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("doc_lengths", "window", "ttt_length", "mode"), CASES)
def test_flex_equals_eager_forward_and_backward_on_gpu(doc_lengths, window, ttt_length, mode):
    docs, pos = packed(doc_lengths, "cuda")
    base = qkv(docs.shape[0], docs.shape[1], ttt_length, "cuda", torch.float32)
    results = {
        "eager": forward_and_grads(EagerTTTAttention(docs, pos, window, mode), base),
        "flex": forward_and_grads(FlexTTTAttention(docs, pos, window, ttt_length, compiled=True, window_mode=mode), base),
    }
    for (g, w) in zip(results["flex"][0], results["eager"][0], strict=True):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-4)
    for gd, wd in zip(results["flex"][1], results["eager"][1], strict=True):
        for g, w in zip(gd, wd, strict=True):
            torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("window", [None, 300])
def test_building_the_block_masks_never_waits_for_the_gpu(window):
    """A whole-step compiled trainer builds every depth's mask eagerly before the graph; a host
    sync there stalls the step until the GPU is idle (14 a step, profiled on the H200)."""
    docs, pos = packed([[700, 300, 500], [1500]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masks = FlexTTTAttention(docs, pos, window, 7, compiled=False).all_block_masks()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(masks) == 7


def test_window_modes_differ_only_past_depth_zero():
    """'context' keeps W context keys at every depth (eagle-harness serves it); 'position' drops
    one more per depth (measured from the drafted token). Equal at depth 0; unknown modes refused."""
    docs, pos = packed([[40]])
    for depth in range(3):
        context = ttt_base_mask_of(docs, pos, depth, 8, "context")
        position = ttt_base_mask_of(docs, pos, depth, 8, "position")
        assert context[0, 39].sum() == 8 and position[0, 39].sum() == 8 - depth
        assert torch.equal(context, position) == (depth == 0)
    with pytest.raises(ValueError, match="unknown window_mode 'chain'"):
        EagerTTTAttention(docs, pos, 8, "chain")


def ttt_base_mask_of(docs, pos, depth, window, mode):
    from pipelines.models.ttt_attention import ttt_base_mask

    return ttt_base_mask(docs, pos, depth, window, mode)
