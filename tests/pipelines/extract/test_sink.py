"""The worker's write path: host buffers allocated once and reused; features encoded where they are
(on the GPU before the copy, with a GPU) and written as what the CPU encoder gives."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from hsstore import FeatureSpec, Lineage, ShardWriter, commit_shards
from hsstore.format import codecs
from pipelines.extract.sink import HostBufferPool, ShardSink
from pipelines.extract.units import SampleRow

FEATURES = [
    FeatureSpec(name="aux_hidden_states", shape=(3, 64), codec="fp8_e4m3"),
    FeatureSpec(name="final_hidden_state", shape=(64,), codec="bf16"),
]


def test_pool_reuses_its_buffers_and_blocks_when_all_are_out() -> None:
    pool = HostBufferPool(FEATURES, max_tokens=128, num_buffers=2, pin=False)
    assert sorted(n for n, _, _ in pool.arrays) == ["aux_hidden_states", "aux_hidden_states.scale", "final_hidden_state"]
    assert pool.bytes_per_set == 128 * (3 * 64 + 3 * 4 + 64 * 2)
    first, second = pool.acquire(100), pool.acquire(128)
    assert first["aux_hidden_states"].shape == (128, 3, 64) and first["final_hidden_state"].dtype == torch.int16
    got: list[dict[str, torch.Tensor]] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(10)))
    waiter.start()
    time.sleep(0.7)
    assert not got  # both sets are out: the third acquire waits (back-pressure)
    pool.release(first)
    waiter.join(timeout=5)
    assert got and got[0]["aux_hidden_states"].data_ptr() == first["aux_hidden_states"].data_ptr()
    oversize = pool.acquire(1000)  # over max_tokens: a one-off, not kept
    assert oversize["final_hidden_state"].shape[0] == 1000
    pool.release(oversize)
    pool.release(second)
    assert pool.acquire(1)["final_hidden_state"].data_ptr() == second["final_hidden_state"].data_ptr()


def test_acquire_stops_waiting_when_told() -> None:
    pool = HostBufferPool(FEATURES, max_tokens=8, num_buffers=1, pin=False)
    pool.acquire(8)

    def writer_failed() -> None:
        raise RuntimeError("writer thread died")

    with pytest.raises(RuntimeError, match="writer thread died"):
        pool.acquire(8, writer_failed)


def write_through_sink(
    store: Path,
    device: torch.device,
    batches: list[tuple[list[SampleRow], dict[str, torch.Tensor]]],
    *,
    pace_points: int = 0,
    copy_pieces: int = 4,
) -> None:
    """``pace_points``: calls of ``sink.pace()`` between batches, each after some GPU work, as the
    next forward's pace layers make them (0: never paced, every copy goes when the next is submitted)."""
    pool = HostBufferPool(FEATURES, 64, 3, pin=device.type == "cuda")
    sink = ShardSink(ShardWriter(store, "u000000", FEATURES), device, pool=pool, max_pending_batches=1, copy_pieces=copy_pieces)
    work = torch.randn(512, 512, device=device)
    for rows, features in batches:
        for _ in range(pace_points):
            work = torch.tanh(work @ work)  # a "layer" of the next forward
            sink.pace()
        sink.submit(rows, {name: values.to(device) for name, values in features.items()})
    if device.type == "cuda":
        sink.flush_copies()
    record = sink.finish()
    assert sink.write_seconds > 0
    commit_shards(str(store), [record], features=FEATURES, lineage=Lineage())


def make_batches(seed: int) -> list[tuple[list[SampleRow], dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    batches, count = [], 0
    for lengths in ([20, 12], [30], [7, 9, 11], [40]):
        rows = []
        for n in lengths:
            rows.append(SampleRow(f"s{count}", f"r{count}", np.arange(n, dtype=np.int32), np.ones(n, np.uint8)))
            count += 1
        total = sum(lengths)
        features = {
            "aux_hidden_states": (torch.randn(total, 3, 64, generator=generator) * 30).to(torch.bfloat16),
            "final_hidden_state": torch.randn(total, 64, generator=generator).to(torch.bfloat16),
        }
        batches.append((rows, features))
    return batches


def stored_bits(store: Path) -> dict[str, np.ndarray]:
    opened = hsstore.open_store(str(store))
    out: dict[str, list[np.ndarray]] = {}
    for index in range(opened.num_samples):
        sample = opened.read_sample(index)
        for name in ("aux_hidden_states", "final_hidden_state"):
            out.setdefault(name, []).append(sample[name].view(torch.int16).numpy())
    return {name: np.concatenate(parts) for name, parts in out.items()}


def expected_bits(batches: list[tuple[list[SampleRow], dict[str, torch.Tensor]]]) -> dict[str, np.ndarray]:
    """Every batch encoded on the CPU and decoded, in order: what a reader of the store must see."""
    out: dict[str, list[np.ndarray]] = {}
    for _, features in batches:
        for spec in FEATURES:
            raw = codecs.encode(spec, features[spec.name])
            out.setdefault(spec.name, []).append(codecs.decode_torch(spec, raw).view(torch.int16).numpy())
    return {name: np.concatenate(parts) for name, parts in out.items()}


def test_cpu_sink_writes_what_the_cpu_encoder_gives(tmp_path: Path) -> None:
    batches = make_batches(0)
    write_through_sink(tmp_path / "store", torch.device("cpu"), batches)
    got, want = stored_bits(tmp_path / "store"), expected_bits(batches)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.gpu
def test_gpu_sink_encodes_on_the_device_and_stores_the_cpu_encoders_bits(tmp_path: Path) -> None:
    """More batches than buffers (3 sets, 4 batches, one pending): the pool is reused under load."""
    batches = make_batches(1)
    write_through_sink(tmp_path / "store", torch.device("cuda"), batches)
    got, want = stored_bits(tmp_path / "store"), expected_bits(batches)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.gpu
@pytest.mark.parametrize(("pace_points", "copy_pieces"), [(3, 3), (4, 4), (2, 4), (6, 4), (4, 50)])
def test_gpu_sink_copies_in_paced_pieces_and_stores_the_cpu_encoders_bits(
    tmp_path: Path, pace_points: int, copy_pieces: int
) -> None:
    """Pieces of uneven sizes (32 tokens in 3), more pieces than a batch has tokens (50), fewer pace
    points than pieces (the rest goes at the next submit) and more (the extra ones find nothing)."""
    batches = make_batches(2)
    write_through_sink(tmp_path / "store", torch.device("cuda"), batches, pace_points=pace_points, copy_pieces=copy_pieces)
    got, want = stored_bits(tmp_path / "store"), expected_bits(batches)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_preallocated_sets_are_the_ones_handed_out() -> None:
    pool = HostBufferPool(FEATURES, max_tokens=16, num_buffers=2, pin=False)
    pool.preallocate()
    pointers = set()
    for _ in range(2):
        pointers.add(pool.acquire(16)["final_hidden_state"].data_ptr())
    assert len(pointers) == 2 and pool._allocated == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gpus", [1, 2])
def test_a_cuda_worker_paces_its_copies_and_stores_what_a_cpu_worker_stores(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int
) -> None:
    """Two units of several batches each: every batch's copy rides the next forward's pace layers,
    a unit's last batch is copied when its forwards end; the store matches the CPU worker's. With 2
    GPUs the target is split (placement.py): pace layers on the first GPU, copies from the second."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    from pipelines.extract.executors import LocalExecutor
    from pipelines.extract.units import WorkUnit
    from pipelines.extract.worker_spec import WorkerSpec
    from tests.pipelines.extract.helpers import relative_error

    paced_with_work: list[int] = []  # pace points that found a pending copy
    pace = ShardSink.pace

    def counted_pace(self: ShardSink) -> None:
        paced_with_work.extend([1] if self._copies else [])
        pace(self)

    monkeypatch.setattr(ShardSink, "pace", counted_pace)
    rng = np.random.default_rng(3)
    rows = [
        SampleRow(f"s{i}", f"r{i}", rng.integers(3, 8192, n).astype(np.int32), np.ones(n, np.uint8))
        for i, n in enumerate(rng.integers(20, 120, 24))
    ]
    units = [WorkUnit(0, tuple(rows[:12])), WorkUnit(1, tuple(rows[12:]))]
    features = (FeatureSpec(name="aux_hidden_states", shape=(2, 64)), FeatureSpec(name="final_hidden_state", shape=(64,)))
    stores = {}
    for device in ("cpu", "cuda"):
        store = tmp_path / device
        spec = WorkerSpec(target=str(tiny_qwen3), store=str(store), features=features, aux_layer_ids=(1, 3),
                          dtype="float32", device=device, token_budget=256, max_length=128,
                          num_gpus=gpus if device == "cuda" else 1)
        executor = LocalExecutor(spec)
        results: list = []
        executor.run(units, results.append)
        executor.close()
        assert len(results) == 2 and all(r.num_batches > 2 for r in results)
        if device == "cuda":
            assert executor.worker.capture.pace_layers == (0, 1, 2, 3)
            # Each forward but a unit's first paces the batch before it, in 4 pieces.
            assert len(paced_with_work) == 4 * sum(r.num_batches - 1 for r in results)
            # The GPU timeline (CUDA events around each forward): one GPU only.
            if gpus == 1:
                assert all(r.gpu_forward_seconds > 0 for r in results)
                assert results[0].gpu_between_seconds > 0 and results[1].gpu_between_seconds > 0
                # On the wall clock: each unit's forwards run on the GPU after its host loop began,
                # the second unit's after the first's (one compute thread, one stream).
                first, second = sorted(results, key=lambda r: r.unit_index)
                assert first.compute_started_at - 0.01 < first.gpu_started_at < first.gpu_ended_at
                assert first.gpu_ended_at <= second.gpu_started_at + 1e-3 < second.gpu_ended_at + 1e-3
            else:
                assert all(r.gpu_forward_seconds == 0 for r in results)
        else:
            assert all(r.gpu_forward_seconds == 0 == r.gpu_between_seconds for r in results)
        commit_shards(str(store), [r.record for r in results], features=list(features), lineage=Lineage())
        stores[device] = hsstore.open_store(str(store))
    cpu, gpu = stores["cpu"], stores["cuda"]
    assert cpu.samples["sample_id"].to_pylist() == gpu.samples["sample_id"].to_pylist()
    for index in range(cpu.num_samples):
        a, b = cpu.read_sample(index), gpu.read_sample(index)
        for name in ("aux_hidden_states", "final_hidden_state"):
            assert relative_error(b[name], a[name]) < 1e-2, (index, name)
