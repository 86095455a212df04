"""Copying a response body into the caller's buffers (hsstore.read_cache.Scatter, scatter): the
bytes land where a single read into those buffers would put them, however the body is cut."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hsstore.read_cache import Scatter, scatter


@settings(max_examples=200, deadline=None)
@given(
    part_sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=12),
    extra=st.integers(-30, 10),
)
def test_pieces_land_where_one_read_would_put_them(part_sizes: list[int], cuts: list[int], extra: int) -> None:
    total = sum(part_sizes)
    body = np.random.default_rng(total).integers(0, 256, max(0, total + extra), dtype=np.uint8).tobytes()
    backing = np.full(total + 8, 0xEE, dtype=np.uint8)  # the parts side by side, a guard at the end
    parts, at = [], 0
    for size in part_sizes:
        parts.append(backing[at : at + size])
        at += size
    filler = Scatter(parts)
    assert filler.nbytes == total
    bounds = sorted({0, len(body), *(min(c, len(body)) for c in cuts)})
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        filler.write(body[lo:hi])
    assert filler.received == len(body)  # a long body is counted whole: the caller sees it is wrong
    got = min(len(body), total)
    assert backing[:got].tobytes() == body[:got]
    assert (backing[got:] == 0xEE).all()  # nothing written past the body or past the buffers


def test_scatter_is_one_piece_over_buffers_of_any_kind() -> None:
    target = np.zeros(6, dtype=np.uint8)
    other = bytearray(3)
    scatter(b"abcdefghi", [target, memoryview(other)])
    assert target.tobytes() == b"abcdef" and bytes(other) == b"ghi"
