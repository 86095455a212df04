"""CRC-32C (Castagnoli): the checksum of Zarr's ``crc32c`` codec, on every inner chunk and index.

Computed with the ``crc32c`` package, which releases the GIL while it hashes a buffer of 32 KiB or
more. ``google-crc32c`` (zarr's own dependency, the same checksum) holds it: the extraction
worker's writer threads checksum ~1 GB per batch, and while they held the GIL the thread that
launches the target's kernels waited (the GPU's forwards ran ~3% slower than a bare forward;
benchmarks/RESULTS.md, issue 13). The same holds for the loader's read threads and the training
loop. Both packages give the same values (tested).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import crc32c as _crc32c

CRC_BYTES = 4  # stored little endian after what it covers


def crc32c_bytes(parts: Iterable[Any]) -> bytes:
    """The CRC-32C of the parts' bytes one after another (each anything with the buffer protocol:
    bytes, memoryview, a contiguous numpy array), as stored: 4 bytes, little endian."""
    value = 0
    for part in parts:
        value = _crc32c.crc32c(part, value)
    return value.to_bytes(CRC_BYTES, "little")
