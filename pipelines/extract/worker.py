"""The extraction worker: owns the target model and turns work units into shards.

One worker per GPU (a Ray actor) or one in process (the local executor): the same class either
way, so a profile of the in-process run is a profile of what the actors do. A unit is written as
one shard with a deterministic id (``u000042`` for unit 42), so a retried or re-run unit can only
ever produce the same shard; the shard's files go to their own attempt folder and only the
driver's manifest commit makes them visible (hsstore's ShardWriter contract).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hsstore import FeatureSpec, ShardRecord, ShardWriter
from pipelines.extract.batching import collate, plan_batches
from pipelines.extract.capture import HiddenStateCapture
from pipelines.extract.sink import SampleRow, ShardSink

logger = logging.getLogger(__name__)


def unit_shard_id(unit_index: int) -> str:
    """The shard a unit writes: deterministic, so retries and reruns recognise it."""
    return f"u{unit_index:06d}"


@dataclass(frozen=True)
class WorkUnit:
    """Consecutive accepted samples, written together as one shard."""

    index: int
    rows: tuple[SampleRow, ...]

    @property
    def shard_id(self) -> str:
        return unit_shard_id(self.index)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.rows)


@dataclass(frozen=True)
class UnitResult:
    """What a worker returns for a unit: the record to commit and what it cost."""

    unit_index: int
    record: ShardRecord
    num_samples: int
    num_tokens: int
    num_padded_tokens: int
    num_batches: int
    seconds: float  # the whole unit, shard finished
    compute_seconds: float  # holding the model (forwards; the GPU work may still be queued)
    write_seconds: float  # the writer thread's busy time


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable (it travels to Ray actors)."""

    target: str  # local model directory
    store: str
    features: tuple[FeatureSpec, ...]
    aux_layer_ids: tuple[int, ...]
    final_hidden_state: bool = True
    topk_k: int | None = None
    topk_chunk_tokens: int = 4096
    dtype: str = "bfloat16"
    device: str = "auto"
    attn_implementation: str | None = "sdpa"
    trust_remote_code: bool = False
    token_budget: int = 16384
    max_batch_size: int | None = None
    pad_to_multiple_of: int = 8
    pass_attention_mask: bool = True
    pad_token_id: int = 0
    storage_options: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target(
    target: str,
    *,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The target as an eval-mode ``AutoModelForCausalLM`` on ``device`` (weights loaded there)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    kwargs: dict[str, Any] = {
        "dtype": getattr(torch, dtype),
        "trust_remote_code": trust_remote_code,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # load straight onto the GPU, no host copy of 16 GB
    model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
    if device.type != "cuda":
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


class ExtractionWorker:
    """Loads the target once; :meth:`run_unit` writes one unit's shard and returns its record."""

    def __init__(self, spec: WorkerSpec, model: torch.nn.Module | None = None):
        """``model``: an already loaded target (benchmarks, tests); default: load ``spec.target``."""
        self.spec = spec
        self.device = resolve_device(spec.device)
        self.model = (
            model
            if model is not None
            else load_target(
                spec.target,
                dtype=spec.dtype,
                device=self.device,
                attn_implementation=spec.attn_implementation,
                trust_remote_code=spec.trust_remote_code,
            )
        )
        self._compute_lock = threading.Lock()
        self.capture = HiddenStateCapture(
            self.model,
            spec.aux_layer_ids,
            final_hidden_state=spec.final_hidden_state,
            topk_k=spec.topk_k,
            topk_chunk_tokens=spec.topk_chunk_tokens,
            pass_attention_mask=spec.pass_attention_mask,
        )

    def run_unit(
        self, unit: WorkUnit, on_batch: Callable[[int, int], None] | None = None
    ) -> UnitResult:
        """Run the target over a unit and write its shard (not committed: the driver does that).

        Thread-safe, and meant to be called from two threads: the forwards run under a lock, one
        unit at a time, but finishing a shard (last flushes, sample table, checksumming every
        file: seconds for GBs) happens outside it, so the next unit's forwards overlap it.
        ``on_batch(num_samples, num_tokens)`` is called after each batch (progress bars).
        """
        start = time.perf_counter()
        token_ids = [row.input_ids for row in unit.rows]
        batches = plan_batches(
            [len(ids) for ids in token_ids],
            self.spec.token_budget,
            max_batch_size=self.spec.max_batch_size,
            pad_to_multiple_of=self.spec.pad_to_multiple_of,
        )
        with self._compute_lock:
            compute_start = time.perf_counter()
            writer = ShardWriter(
                self.spec.store,
                unit.shard_id,
                list(self.spec.features),
                storage_options=self.spec.storage_options,
            )
            sink = ShardSink(writer, self.device)
            try:
                for batch in batches:
                    input_ids_BT, attention_mask_BT = collate(
                        token_ids, batch, self.spec.pad_token_id
                    )
                    # Flat indices of the real tokens, computed here so the GPU is never asked.
                    valid_index_N = np.flatnonzero(attention_mask_BT.reshape(-1))
                    features = self.capture(
                        _to_device(input_ids_BT, self.device),
                        _to_device(attention_mask_BT, self.device),
                        _to_device(valid_index_N, self.device),
                    )
                    sink.submit([unit.rows[i] for i in batch.indices], features)
                    if on_batch is not None:
                        on_batch(len(batch.indices), batch.num_tokens)
            except BaseException:
                sink.abort()
                raise
            compute_seconds = time.perf_counter() - compute_start
        try:
            record = sink.finish()
        except BaseException:
            sink.abort()
            raise
        return UnitResult(
            unit_index=unit.index,
            record=record,
            num_samples=len(unit.rows),
            num_tokens=sum(b.num_tokens for b in batches),
            num_padded_tokens=sum(b.num_padded_tokens for b in batches),
            num_batches=len(batches),
            seconds=time.perf_counter() - start,
            compute_seconds=compute_seconds,
            write_seconds=sink.write_seconds,
        )

    def close(self) -> None:
        self.capture.close()


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
