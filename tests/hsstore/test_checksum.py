"""hsstore.checksum: the CRC-32C of Zarr's crc32c codec, computed without holding the GIL."""

from __future__ import annotations

import threading
import time

import google_crc32c  # zarr's own checksum package: the values must agree with it
import numpy as np
import pytest

from hsstore.checksum import CRC_BYTES, crc32c_bytes


def test_the_standard_check_value() -> None:
    assert crc32c_bytes([b"123456789"]) == (0xE3069283).to_bytes(CRC_BYTES, "little")  # CRC-32C check value


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 1 << 20])
def test_the_same_values_as_zarrs_crc32c(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert crc32c_bytes([data]) == int(google_crc32c.value(data.tobytes())).to_bytes(CRC_BYTES, "little")


def test_parts_are_checksummed_as_one_buffer() -> None:
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)
    parts = [data[:10], memoryview(data[10:5000]), data[5000:].tobytes()]
    assert crc32c_bytes(parts) == crc32c_bytes([data])


def test_another_thread_runs_while_a_large_buffer_is_checksummed() -> None:
    """What the module is for: the writer threads' checksums must not stop the thread that launches
    the GPU's kernels. A thread notes the time in a loop: while a checksum holds the GIL it notes
    next to nothing (google-crc32c on a numpy array: ~4% of its rate between calls); while the
    GIL is free it goes on at its rate (on two cores)."""
    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    notes: list[float] = []
    stop = threading.Event()

    def note() -> None:
        while not stop.is_set():
            notes.append(time.perf_counter())

    thread = threading.Thread(target=note)
    thread.start()
    spans = []
    try:
        time.sleep(0.05)
        for _ in range(10):
            start = time.perf_counter()
            crc32c_bytes([data])
            spans.append((start, time.perf_counter()))
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    inside = sum(1 for t in notes for a, b in spans if a < t < b)
    busy = sum(b - a for a, b in spans)
    rate_inside = inside / busy
    rate_outside = (len(notes) - inside) / (notes[-1] - notes[0] - busy)
    assert rate_inside > 0.25 * rate_outside, (rate_inside, rate_outside)
