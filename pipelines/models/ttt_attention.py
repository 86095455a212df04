"""Attention for the EAGLE-3/4 training-time test (TTT), without dense masks on the GPU.

At TTT depth i a query at position t sees (docs/draft-model.md):

- the depth-0 keys of positions s <= t of its own document (within the sliding window, if any:
  ``position[t] - position[s] < W`` with ``window_mode="context"``, the W most recent context
  keys as eagle-harness serves EAGLE-4; ``position[t] + i - position[s] < W`` with
  ``"position"``, the window measured from the drafted token's own RoPE position), and
- its own keys from depths 1..i (the draft's drafted chain at that position).

Three implementations give the same result:

``EagerTTTAttention`` (the reference, float64 tests, any device): depth 0 through SDPA with a
dense ``[B, T, T]`` bool mask; depths >= 1 score the depth-0 keys as one ``[T, T]`` matrix and the
own keys as per-position dot products. Simple and exact, but it materialises T x T scores, which
at T = 8192 cost gigabytes and a third of the step on an H200.

``SegmentedTTTAttention`` (the CPU's default): the same formula per document run of each packed
row, so the scores are ``sum(L_d^2)`` rather than ``T^2`` and unwindowed runs need no mask.

``FlexTTTAttention`` (CUDA): one fused ``flex_attention`` call per depth over the keys of every
depth laid side by side, ``[k_0 | k_1 | ... | k_{L-1}]`` (each region padded to a multiple of the
128-token block), with a block-sparse mask built from the packed row's document runs and positions:
depth-0 blocks below the diagonal are *full* (no mask evaluated) when both blocks lie in one
document, *partial* where a document boundary, the diagonal or the window cuts through, and absent
otherwise; each own-key region j <= i contributes only its diagonal blocks. So the work is that of
one document-causal attention plus a thin diagonal, and nothing T x T is ever stored. The key
length is the same at every depth (regions past i are absent from the mask), so one compiled
kernel serves all depths.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 128  # flex_attention's default block size; rows are padded to a multiple of it


def run_ids(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Contiguous runs of equal document ids numbered 0, 1, 2, ... along each row (int32).

    Documents are contiguous runs in packed rows; numbering the runs makes the ids monotone,
    which lets a block's document range be read off its first and last token."""
    new_run = torch.ones_like(doc_ids_BT, dtype=torch.int32)
    new_run[:, 1:] = (doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]).to(torch.int32)
    return new_run.cumsum(-1, dtype=torch.int32) - 1


WINDOW_MODES = ("context", "position")


def window_shift(window_mode: str, depth: int) -> int:
    """How far the window's end moves at depth ``depth``: 0 when it counts context keys (the
    chain's d keys come on top), ``depth`` when it is measured from the drafted position."""
    if window_mode not in WINDOW_MODES:
        raise ValueError(f"unknown window_mode {window_mode!r} (one of {', '.join(WINDOW_MODES)})")
    return depth if window_mode == "position" else 0


def ttt_base_mask(
    doc_ids_BT: torch.Tensor,
    position_ids_BT: torch.Tensor,
    depth: int,
    sliding_window: int | None,
    window_mode: str = "context",
) -> torch.Tensor:
    """Bool [B, T, T]: which depth-0 keys the depth-``depth`` query at t sees (causal, same
    document, windowed by RoPE distance; ``window_mode`` as in the module docstring)."""
    T = doc_ids_BT.shape[1]
    idx = torch.arange(T, device=doc_ids_BT.device)
    runs = run_ids(doc_ids_BT)
    base = (idx[None, :, None] >= idx[None, None, :]) & (runs[:, :, None] == runs[:, None, :])
    if sliding_window is not None:
        shift = window_shift(window_mode, depth)
        distance = position_ids_BT[:, :, None] + shift - position_ids_BT[:, None, :]
        base = base & (distance < sliding_window)
    return base


def attend_with_own_keys(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    base_mask_BTS: torch.Tensor | None,
) -> torch.Tensor:
    """Dense TTT attention of one depth: ``keys[0]``/``values[0]`` are the depth-0 keys (visible
    where ``base_mask_BTS`` is True; None = plain causal), ``keys[1:]`` the query position's own
    keys of depths 1..i (one each). Depth 0 goes through SDPA; deeper depths score one [T, S]
    matrix over the depth-0 keys plus, per position, a dot product with each own key (never the
    T x iT blocks a concatenated cache would need)."""
    k0, v0 = keys[0], values[0]
    B, N, T, D = q_BNTD.shape
    num_kv = k0.shape[1]
    if len(keys) == 1:
        groups = N // num_kv
        return F.scaled_dot_product_attention(
            q_BNTD,
            k0.repeat_interleave(groups, dim=1),
            v0.repeat_interleave(groups, dim=1),
            attn_mask=None if base_mask_BTS is None else base_mask_BTS[:, None],
            is_causal=base_mask_BTS is None,
        )
    if base_mask_BTS is None:
        base_mask_BTS = torch.ones(T, T, dtype=torch.bool, device=q_BNTD.device).tril()[None]
    q = q_BNTD.view(B, num_kv, N // num_kv, T, D)  # group query heads per kv head
    scale = 1.0 / math.sqrt(D)
    base_scores = torch.einsum("bhgtd,bhsd->bhgts", q, k0) * scale
    base_scores = base_scores.masked_fill(~base_mask_BTS[:, None, None], float("-inf"))
    own_k = torch.stack(keys[1:], dim=3)  # [B, kv, T, i, D]
    own_v = torch.stack(values[1:], dim=3)
    own_scores = torch.einsum("bhgtd,bhtid->bhgti", q, own_k) * scale
    scores = torch.cat([base_scores, own_scores], dim=-1)
    weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    # One split (its backward is one concatenation), not a slice or select per own key, whose
    # backward would each zero-fill a whole [T, S + i] gradient.
    base_w, own_w = weights.to(q.dtype).split([k0.shape[2], len(keys) - 1], dim=-1)
    out = torch.einsum("bhgts,bhsd->bhgtd", base_w, v0) + torch.einsum("bhgti,bhtid->bhgtd", own_w, own_v)
    return out.reshape(B, N, T, D)


class _KeysByDepth:
    """The keys and values of each depth of one unroll, attended in order 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def _push(self, k: torch.Tensor, v: torch.Tensor, depth: int) -> None:
        if depth != len(self.keys):
            raise ValueError(f"depth {depth} attended out of order (expected {len(self.keys)})")
        self.keys.append(k)
        self.values.append(v)


class EagerTTTAttention(_KeysByDepth):
    """The reference implementation: one dense ``[T, T]`` mask per row and explicit scores (see
    the module docstring). Exact on any device; the tests compare the others with it."""

    def __init__(
        self,
        doc_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        sliding_window: int | None,
        window_mode: str = "context",
    ) -> None:
        super().__init__()
        window_shift(window_mode, 0)  # validates the mode
        self.doc_ids = doc_ids_BT
        self.position_ids = position_ids_BT
        self.window = sliding_window
        self.window_mode = window_mode

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, depth: int) -> torch.Tensor:
        """q [B, heads, T, D], k/v [B, kv_heads, T, D] (RoPE applied) -> [B, heads, T, D]."""
        self._push(k, v, depth)
        mask = ttt_base_mask(self.doc_ids, self.position_ids, depth, self.window, self.window_mode)
        return attend_with_own_keys(q, self.keys, self.values, mask)


class SegmentedTTTAttention(EagerTTTAttention):
    """The CPU's default: the reference's dense formula (``attend_with_own_keys``, its masks, its
    rows and window) applied to each document run of each packed row separately. Attention never crosses a document, so a row of documents
    of lengths L_d costs sum(L_d^2) scores instead of T^2 (a row of 1,536 tokens holding documents
    of ~650 costs ~2.4x less), and a run without a window needs no mask at all (SDPA's causal
    kernel at depth 0). Same result as the reference; the run boundaries are read to the host
    once per batch, which is free on the CPU (on CUDA, flex does this work block-sparsely)."""

    def __init__(
        self,
        doc_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        sliding_window: int | None,
        window_mode: str = "context",
    ) -> None:
        super().__init__(doc_ids_BT, position_ids_BT, sliding_window, window_mode)
        self.segments: list[list[tuple[int, int]]] = []
        for runs in run_ids(doc_ids_BT).cpu():  # runs are numbered 0, 1, ... along the row
            bounds = [0, *itertools.accumulate(torch.bincount(runs).tolist())]
            self.segments.append(list(itertools.pairwise(bounds)))

    def _segment_mask(self, b: int, start: int, end: int, depth: int) -> torch.Tensor | None:
        """Causal (None) or the reference's mask of the run (causal, windowed), [1, L, L]."""
        if self.window is None:
            return None
        cut = (slice(b, b + 1), slice(start, end))
        return ttt_base_mask(
            self.doc_ids[cut], self.position_ids[cut], depth, self.window, self.window_mode
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, depth: int) -> torch.Tensor:
        """q [B, heads, T, D], k/v [B, kv_heads, T, D] (RoPE applied) -> [B, heads, T, D]."""
        self._push(k, v, depth)
        rows = []
        for b, segments in enumerate(self.segments):
            parts = []
            for start, end in segments:
                cut = (slice(b, b + 1), slice(None), slice(start, end))
                parts.append(attend_with_own_keys(
                    q[cut], [x[cut] for x in self.keys], [x[cut] for x in self.values],
                    self._segment_mask(b, start, end, depth),
                ))
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
        return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


_COMPILED_FLEX: Any = None


def _flex_attention(compiled: bool) -> Any:
    """torch's flex_attention, compiled once per process (eager flex is a slow reference path).
    Inside a compiled region (the trainer's ``compile: step``) the plain function: the enclosing
    compilation lowers it to the same fused kernel, with no nested compiled call to trace."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled or torch.compiler.is_compiling():
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


class FlexTTTAttention(_KeysByDepth):
    """Fused block-sparse attention over ``[k_0 | k_1 | ... | k_{L-1}]`` (module docstring).

    Built once per batch: block-level document and position ranges are computed here, each depth's
    block mask in ``attend`` from them (tensors of [B, T/128, L*T/128] entries, no T x T work).
    ``compiled=False`` runs flex's eager reference path (CPU tests, forward only).

    ``block_masks``: every depth's mask built beforehand (:meth:`all_block_masks` of an instance
    made outside). A whole-step compiled graph needs this: inductor cannot lower flex attention
    whose mask reads tensors computed inside the same graph (the row's run ids, the depth), so
    the trainer builds the masks eagerly and hands them in, where they are graph inputs."""

    def __init__(
        self,
        doc_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        sliding_window: int | None,
        ttt_length: int,
        compiled: bool = True,
        window_mode: str = "context",
        block_masks: list[Any] | None = None,
    ) -> None:
        window_shift(window_mode, 0)  # validates the mode
        self.window_mode = window_mode
        B, T = doc_ids_BT.shape
        self.T = T
        self.Tp = -(-T // BLOCK) * BLOCK
        self.num_blocks = self.Tp // BLOCK
        self.ttt_length = ttt_length
        self.window = sliding_window
        self.flex = _flex_attention(compiled)
        super().__init__()
        if block_masks is not None and len(block_masks) != ttt_length:
            raise ValueError(f"{len(block_masks)} block masks given for ttt_length={ttt_length}")
        self.block_masks = block_masks
        if block_masks is not None:
            return  # nothing else is read: the masks hold the row's runs and positions
        pad = self.Tp - T
        runs = run_ids(doc_ids_BT)
        positions = position_ids_BT.to(torch.int32)
        if pad:  # padding is one more run at the end, attending causally among itself
            runs = torch.cat([runs, (runs[:, -1:] + 1).expand(B, pad)], dim=1)
            positions = F.pad(positions, (0, pad), value=0)
        self.runs, self.positions = runs, positions
        blocks = (B, self.num_blocks, BLOCK)
        self.run_first = runs.view(blocks)[:, :, 0]  # runs are monotone: first = min, last = max
        self.run_last = runs.view(blocks)[:, :, -1]
        self.pos_min = positions.view(blocks).amin(-1)
        self.pos_max = positions.view(blocks).amax(-1)

    def _pad(self, x_BNTD: torch.Tensor) -> torch.Tensor:
        return F.pad(x_BNTD, (0, 0, 0, self.Tp - self.T)) if self.Tp != self.T else x_BNTD

    def block_mask(self, depth: int) -> Any:
        """The BlockMask of depth ``depth`` over Q = Tp queries and L * Tp keys."""
        from torch.nn.attention.flex_attention import BlockMask

        n, L, Tp, window = self.num_blocks, self.ttt_length, self.Tp, self.window
        shift = window_shift(self.window_mode, depth)
        device = self.runs.device
        qb = torch.arange(n, device=device)
        below = qb[None, :, None] >= qb[None, None, :]  # [1, q block, kv block]: causal blocks
        strictly_below = qb[None, :, None] > qb[None, None, :]
        q_first, q_last = self.run_first[:, :, None], self.run_last[:, :, None]
        k_first, k_last = self.run_first[:, None, :], self.run_last[:, None, :]
        # A kv block earlier in the row shares a document with the q block iff its last run
        # reaches the q block's first run; both blocks lie in one document iff k_first == q_last.
        nonempty = below & (k_last >= q_first)
        full = strictly_below & (k_first == q_last)
        if window is not None:
            # Bounds valid for any positions: every same-document pair's distance lies in
            # [q_pos_min - k_pos_max, q_pos_max - k_pos_min] + shift.
            nonempty &= (self.pos_min[:, :, None] - self.pos_max[:, None, :] + shift) < window
            full &= (self.pos_max[:, :, None] - self.pos_min[:, None, :] + shift) < window
        partial = nonempty & ~full
        B = partial.shape[0]
        eye = torch.eye(n, dtype=torch.bool, device=device)
        diagonal = [eye if 1 <= j <= depth else torch.zeros_like(eye) for j in range(1, L)]
        partial_all = torch.cat([partial, *(d.expand(B, n, n) for d in diagonal)], dim=-1)
        full_all = torch.cat([full, torch.zeros(B, n, (L - 1) * n, dtype=torch.bool, device=device)], -1)

        def listing(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            count = blocks.sum(-1, dtype=torch.int32)
            order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
            return count[:, None], order[:, None]

        runs, positions = self.runs, self.positions
        # Tensors, not ints, so that one compiled kernel serves every depth; filled on the device
        # because ``torch.tensor(x, device="cuda")`` copies from pageable memory and waits for the
        # stream: two host syncs per depth, 14 a TTT-7 step, each leaving the GPU idle while the
        # host launches what follows (benchmarks/LOG.md, "the step's host syncs").
        depth_t = torch.full((), depth, dtype=torch.int32, device=device)
        shift_t = torch.full((), shift, dtype=torch.int32, device=device)

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            region = kv_idx // Tp
            key = kv_idx - region * Tp
            base = (region == 0) & (key <= q_idx) & (runs[b, q_idx] == runs[b, key])
            if window is not None:
                base = base & (positions[b, q_idx] + shift_t - positions[b, key] < window)
            own = (region >= 1) & (region <= depth_t) & (key == q_idx)
            return base | own

        kv_num, kv_idx = listing(partial_all)
        full_num, full_idx = listing(full_all)
        return BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
            seq_lengths=(Tp, L * Tp),
        )

    def all_block_masks(self) -> list[Any]:
        """The block mask of every depth, for a later instance's ``block_masks``."""
        return [self.block_mask(depth) for depth in range(self.ttt_length)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, depth: int) -> torch.Tensor:
        """q [B, heads, T, D], k/v [B, kv_heads, T, D] (RoPE applied) -> [B, heads, T, D]."""
        self._push(self._pad(k), self._pad(v), depth)
        block_mask = self.block_masks[depth] if self.block_masks is not None else self.block_mask(depth)
        absent = [torch.zeros_like(self.keys[0])] * (self.ttt_length - 1 - depth)
        keys = torch.cat([*self.keys, *absent], dim=2)
        values = torch.cat([*self.values, *absent], dim=2)
        out = self.flex(
            self._pad(q), keys, values, block_mask=block_mask,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[:, :, : self.T]


def make_ttt_attention(
    backend: str,
    doc_ids_BT: torch.Tensor,
    position_ids_BT: torch.Tensor,
    sliding_window: int | None,
    ttt_length: int,
    window_mode: str = "context",
    block_masks: list[Any] | None = None,
) -> EagerTTTAttention | SegmentedTTTAttention | FlexTTTAttention:
    """``backend``: ``auto`` (flex on CUDA, segmented elsewhere), ``flex``, ``segmented`` or
    ``eager`` (all give the same result). Flex needs CUDA to train: its CPU path has no backward.
    ``block_masks``: flex's masks built beforehand (``FlexTTTAttention``)."""
    if backend == "auto":
        backend = "flex" if doc_ids_BT.is_cuda else "segmented"
    if block_masks is not None and backend != "flex":
        raise ValueError(f"block masks were built for flex attention, not {backend!r}")
    if backend == "flex":
        return FlexTTTAttention(
            doc_ids_BT, position_ids_BT, sliding_window, ttt_length,
            compiled=doc_ids_BT.is_cuda, window_mode=window_mode, block_masks=block_masks,
        )
    if backend == "segmented":
        return SegmentedTTTAttention(doc_ids_BT, position_ids_BT, sliding_window, window_mode)
    if backend == "eager":
        return EagerTTTAttention(doc_ids_BT, position_ids_BT, sliding_window, window_mode)
    raise ValueError(f"unknown TTT attention backend {backend!r} (auto, flex, segmented, eager)")
