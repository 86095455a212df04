"""fp8 features decoded to bf16 by the loader's read threads (``StreamingLoader(decode_on_host=True)``).

A reader reads a sample's fp8 bits and scales into its thread's scratch, then decodes them into the
batch's bf16 slots. Every reader decodes its own samples, so decoding spreads over the read threads
and overlaps the reads of the others; the training device then receives bf16 as stored bf16 is.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np

from hsstore.format import codecs
from hsstore.format.features import FeatureSpec
from hsstore.store import Store


class HostDecoder:
    """Reads token ranges whose fp8 features land decoded, as bf16 bits, in the caller's buffers."""

    def __init__(self, store: Store, decoded: Mapping[str, FeatureSpec]) -> None:
        self.store = store
        self.decoded = dict(decoded)
        self._scratch = threading.local()  # per read thread: the fp8 bits and scales of one sample

    def read(
        self,
        shard_id: str,
        offset: int,
        length: int,
        features: list[str],
        out: dict[str, np.ndarray],
        layers: Mapping[str, Sequence[int]],
    ) -> None:
        """Tokens ``[offset, offset + length)`` of one shard into ``out``, fp8 features as bf16 bits."""
        import torch

        decoded = {name: spec for name, spec in self.decoded.items() if name in features}  # of those read
        targets = {key: value for key, value in out.items() if key not in decoded}
        scratch = self._scratch.__dict__
        for spec in decoded.values():
            for key, per_token, dtype in spec.stored_arrays():
                size = length * int(np.prod(per_token, dtype=np.int64))
                buffer = scratch.get(key)
                if buffer is None or buffer.size < size:
                    buffer = scratch[key] = np.empty(max(size, 2 * (0 if buffer is None else buffer.size)), dtype=dtype)
                targets[key] = buffer[:size].reshape(length, *per_token)
        self.store.read_token_range(shard_id, offset, offset + length, features, out=targets, layers=layers)
        for name, spec in decoded.items():
            bf16 = torch.from_numpy(out[name].view(np.int16)).view(torch.bfloat16)
            raw = {key: targets[key] for key in spec.array_names()}
            codecs.decode_torch(spec, raw, out=bf16, threads=1)
