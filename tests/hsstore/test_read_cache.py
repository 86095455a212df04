"""Copying a response body into the caller's buffers (hsstore.read_cache.Scatter, scatter): the
bytes land where a single read into those buffers would put them, however the body is cut, and
each buffer is reported (``on_filled``) as soon as it is full, in order, so the array reader can
check a chunk's crc32c while its bytes are still in the CPU's cache (issue 32)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hsstore.read_cache import Scatter, report_filled, scatter


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
    ends = np.cumsum(part_sizes).tolist()  # where each part ends in the body
    filled: list[int] = []

    def on_filled(i: int) -> None:
        # Reported in order, once full and before anything past it was copied: "as soon as".
        assert i == len(filled)
        assert backing[: ends[i]].tobytes() == body[: ends[i]]
        assert (backing[ends[i] : total] == 0xEE).all()
        filled.append(i)

    filler = Scatter(parts, on_filled)
    assert filler.nbytes == total
    bounds = sorted({0, len(body), *(min(c, len(body)) for c in cuts)})
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        filler.write(body[lo:hi])
    filler.write(b"")  # an empty piece changes nothing (it reports empty parts the copy reached)
    assert filler.received == len(body)  # a long body is counted whole: the caller sees it is wrong
    got = min(len(body), total)
    assert backing[:got].tobytes() == body[:got]
    assert (backing[got:] == 0xEE).all()  # nothing written past the body or past the buffers
    assert filled == [i for i, end in enumerate(ends) if end <= got]  # a short body: not the last ones


def test_buffers_are_reported_as_the_pieces_cross_them() -> None:
    """Pieces that end inside a buffer, straddle two, or fill several: each buffer is reported by
    the write that completes it, not after the whole body (what the array reader's check needs)."""
    parts = [np.zeros(n, dtype=np.uint8) for n in (3, 4, 0, 2, 5)]
    events: list[object] = []
    filler = Scatter(parts, lambda i: events.append(i))
    # Ends inside 0; completes 0 and 1 (and the empty 2 after it); straddles 3|4; inside 4; past the end.
    for piece in (b"ab", b"cdefg", b"hijk", b"lm", b"no"):
        events.append(piece)
        filler.write(piece)
    assert events == [b"ab", b"cdefg", 0, 1, 2, b"hijk", 3, b"lm", b"no", 4]
    assert b"".join(p.tobytes() for p in parts) == b"abcdefghijklmn"
    assert filler.received == 15  # one byte past the buffers: counted, dropped


def test_one_read_reports_every_buffer_it_filled_after_it() -> None:
    parts = [bytearray(4), np.zeros(0, np.uint8), np.zeros(3, np.uint16), bytearray(2)]  # 4, 0, 6, 2 bytes
    for got, expected in ((12, [0, 1, 2, 3]), (11, [0, 1, 2]), (4, [0, 1]), (3, []), (0, [])):
        reported: list[int] = []
        report_filled(parts, got, reported.append)
        assert reported == expected, got
    report_filled(parts, 12, None)  # no callback: nothing to do


def test_scatter_is_one_piece_over_buffers_of_any_kind() -> None:
    target = np.zeros(6, dtype=np.uint8)
    other = bytearray(3)
    scatter(b"abcdefghi", [target, memoryview(other)])
    assert target.tobytes() == b"abcdef" and bytes(other) == b"ghi"
    reported: list[int] = []
    scatter(b"abcdefghi", [target, memoryview(other)], reported.append)
    assert reported == [0, 1]
