"""Reading a safetensors checkpoint straight into tensors on the device, through pinned host buffers.

Why: ``from_pretrained`` reads each tensor from a memory map and copies it to the GPU from pageable
memory; on an H200 host that takes 13.3 s for the Qwen3-8B shape's 16 GB from the page cache, the
largest part of an extraction's start (benchmarks/LOG.md, issue 31). Here every file's tensor data
is read in large pieces with ``os.preadv`` (which releases the GIL) by several threads at once, each
into its own pinned buffers, and copied to the device asynchronously on the thread's own stream
while its next piece is read; a piece may hold many small tensors or part of a large one.

What is *not* done here: building the model. The tensors go to ``from_pretrained(state_dict=...)``
(target.py), which assigns them without copying and does everything else as usual: renamed or
converted layouts, tied weights, the buffers computed at construction (rotary tables), dtypes.

The file layout read is the safetensors format's own: an 8-byte little-endian header length, a
JSON header naming each tensor's dtype, shape and byte range within the data that follows.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Pieces read at once: large enough that a read and a copy each take ~1 ms at page-cache and
# PCIe speeds, small enough that the pinned buffers (threads x 2 x piece) stay near 0.5 GB.
PIECE_BYTES = 32 << 20
READ_THREADS = 8

_DTYPES = {  # safetensors' names -> torch's attribute names
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


class UnsupportedCheckpoint(Exception):
    """The checkpoint is not one this reader handles (the caller falls back to from_pretrained)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch attribute name
    shape: tuple[int, ...]
    start: int  # byte offsets within the file
    end: int


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file, in file order, with absolute byte offsets."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise UnsupportedCheckpoint(f"{path}: shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(handle.read(header_len))
        except ValueError as err:
            raise UnsupportedCheckpoint(f"{path}: the safetensors header is not JSON ({err})") from err
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise UnsupportedCheckpoint(f"{path}: tensor {name!r} has dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries.append(
            TensorEntry(name, _DTYPES[info["dtype"]], tuple(info["shape"]), data_start + begin, data_start + end)
        )
    return sorted(entries, key=lambda entry: entry.start)


def read_checkpoint(
    files: list[Path],
    device: torch.device,
    *,
    piece_bytes: int = PIECE_BYTES,
    threads: int = READ_THREADS,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``files``, in its stored dtype, on ``device``."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    pieces = []  # (file, first byte, end byte, the entries it touches)
    for path in files:
        header = read_header(path)
        for entry in header:
            tensors[entry.name] = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device=device)
        entries = [entry for entry in header if entry.end > entry.start]
        if not entries:
            continue
        starts = [entry.start for entry in entries]
        for first in range(entries[0].start, entries[-1].end, piece_bytes):
            end = min(first + piece_bytes, entries[-1].end)
            lo = max(bisect.bisect_right(starts, first) - 1, 0)
            hi = bisect.bisect_left(starts, end)
            pieces.append((path, first, end, entries[lo:hi]))
    if not pieces:
        return tensors

    on_cuda = device.type == "cuda"
    local = threading.local()
    # No larger than the largest piece: a small checkpoint pins no 32 MiB buffers it cannot fill.
    buffer_bytes = max(end - first for _, first, end, _ in pieces)

    def staging() -> tuple[list[torch.Tensor], list, torch.cuda.Stream | None]:
        # Two buffers per thread: the next piece is read while the last one is still being copied.
        if not hasattr(local, "buffers"):
            local.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(2)]
            local.events = [None, None]
            local.stream = torch.cuda.Stream(device) if on_cuda else None
            local.turn = 0
        return local.buffers, local.events, local.stream

    def read_piece(piece) -> None:
        path, first, end, entries = piece
        buffers, events, stream = staging()
        turn = local.turn = 1 - local.turn
        if events[turn] is not None:
            events[turn].synchronize()  # its last copy to the device is done: the buffer is free
        view = buffers[turn][: end - first]
        _pread_exactly(descriptors[path], path, view.numpy(), first)
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            for entry in entries:
                lo, hi = max(entry.start, first), min(entry.end, end)
                if lo >= hi:
                    continue
                target = tensors[entry.name].view(-1).view(torch.uint8)
                target[lo - entry.start : hi - entry.start].copy_(view[lo - first : hi - first], non_blocking=on_cuda)
            if on_cuda:
                events[turn] = torch.cuda.Event()
                events[turn].record(stream)

    # One descriptor per file, shared by the threads: os.preadv reads at an offset of its own and
    # leaves the file position alone.
    with contextlib.ExitStack() as stack:
        descriptors = {}
        for path in files:
            descriptors[path] = os.open(path, os.O_RDONLY)
            stack.callback(os.close, descriptors[path])
        with ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-read") as pool:
            list(pool.map(read_piece, pieces))
    if on_cuda:
        torch.cuda.synchronize(device)
    return tensors


def _pread_exactly(fd: int, path: Path, into, offset: int) -> None:
    """Fill ``into`` from ``offset`` of the file open as ``fd`` (``path`` names it in the error)."""
    memory = memoryview(into).cast("B")
    done = 0
    while done < len(memory):
        got = os.preadv(fd, [memory[done:]], offset + done)
        if got == 0:
            raise UnsupportedCheckpoint(f"{path}: ends before byte {offset + len(memory)}")
        done += got

