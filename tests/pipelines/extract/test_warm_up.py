"""The worker's start-up warm-up: one batch of the largest planned shape before any unit, which
loads the device's kernels outside the first unit and checks that the token budget fits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from pipelines.extract.capture import HiddenStateCapture
from pipelines.extract.errors import ExtractionError
from pipelines.extract.sink import ShardSink
from pipelines.extract.target import load_target
from pipelines.extract.warm_up import WARM_WRITE_TOKENS, warm_shape
from pipelines.extract.worker import ExtractionWorker
from pipelines.extract.worker_spec import WorkerSpec

FEATURES = (
    hsstore.FeatureSpec(name="aux_hidden_states", shape=(2, 64), codec="fp8_e4m3"),
    hsstore.FeatureSpec(name="final_hidden_state", shape=(64,)),
)


def spec_for(target: Path, store: Path, device: str = "cpu", **settings: object) -> WorkerSpec:
    return WorkerSpec(
        target=str(target),
        store=str(store),
        features=FEATURES,
        aux_layer_ids=(1, 2),
        device=device,
        **settings,
    )


@pytest.mark.parametrize(
    ("settings", "shape"),
    [
        ({"token_budget": 4096, "max_length": 1000}, (4, 1000)),
        (
            {"token_budget": 4096, "max_length": 1001},
            (4, 1008),
        ),  # rounded up to the padding multiple
        ({"token_budget": 4096, "max_length": 1000, "max_batch_size": 2}, (2, 1000)),
        ({"token_budget": 512}, (1, 512)),  # no max_length: one row of the whole budget
    ],
)
def test_the_warm_up_batch_is_the_largest_the_plan_can_make(
    tiny_qwen3: Path, tmp_path: Path, settings: dict, shape: tuple[int, int]
) -> None:
    spec = spec_for(tiny_qwen3, tmp_path / "store", **settings)
    assert warm_shape(spec) == shape
    worker = ExtractionWorker(spec)
    assert worker.warmup_seconds == 0.0  # on the CPU nothing is loaded lazily: no warm-up at start


def test_warm_up_runs_the_write_path_and_leaves_nothing_behind(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    spec = spec_for(tiny_qwen3, tmp_path / "store", token_budget=256, max_length=64)
    worker = ExtractionWorker(spec)
    # The throwaway shard goes to a temporary folder (here tmp_path/tmp) and is removed.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    written: list[int] = []
    finish = ShardSink.finish

    def counted_finish(self: ShardSink) -> object:
        record = finish(self)
        written.append(record.num_tokens)
        return record

    monkeypatch.setattr(ShardSink, "finish", counted_finish)
    assert worker.warm_up() > 0
    assert written == [min(256, WARM_WRITE_TOKENS)]  # the write path ran: a shard was finished
    assert worker.capture._handles == []  # hooks removed: the model is as loaded
    assert worker.host_buffers._free.qsize() == worker.host_buffers._allocated  # every buffer back
    assert not (tmp_path / "store").exists()  # nothing written to the store
    assert list((tmp_path / "tmp").iterdir()) == []  # nor left in the temporary folder


def test_a_budget_the_device_cannot_hold_fails_at_start_naming_the_setting(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An out-of-memory cannot be provoked on the CPU; the target raises one as CUDA would.
    model = load_target(str(tiny_qwen3), dtype="float32", device="cpu")

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    worker = ExtractionWorker(
        spec_for(tiny_qwen3, tmp_path / "store", token_budget=4096, max_length=2048), model=model
    )
    monkeypatch.setattr(model.model, "forward", out_of_memory)
    with pytest.raises(
        ExtractionError,
        match=r"warm-up batch \(2 x 2048 tokens, batching.token_budget=4096\) ran out of memory",
    ):
        worker.warm_up()
    assert worker.capture._handles == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_worker_warms_up_when_it_starts_and_its_features_are_unchanged(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    spec = spec_for(
        tiny_qwen3,
        tmp_path / "store",
        device="cuda",
        token_budget=1024,
        max_length=256,
        dtype="float32",
    )
    worker = ExtractionWorker(spec)
    assert worker.warmup_seconds > 0
    ids = np.arange(3, 67, dtype=np.int64)[None]
    valid = torch.arange(ids.size, device="cuda")
    after = worker.capture(
        torch.from_numpy(ids).cuda(),
        torch.ones(1, ids.size, dtype=torch.int64, device="cuda"),
        valid,
    )
    # The same capture on a model that never ran a warm-up batch.
    model = load_target(str(tiny_qwen3), dtype="float32", device="cuda")
    cold_features = HiddenStateCapture(model, (1, 2), pass_attention_mask=False)(
        torch.from_numpy(ids).cuda(),
        torch.ones(1, ids.size, dtype=torch.int64, device="cuda"),
        valid,
    )
    for name in ("aux_hidden_states", "final_hidden_state"):
        torch.testing.assert_close(after[name], cold_features[name])


def test_every_forward_runs_on_the_workers_one_compute_thread(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Units are handed in from several threads (Ray's, LocalExecutor's pool), but the forwards all
    run on the worker's compute thread, the one its warm-up ran on: CUDA's per-thread state (cuBLAS
    handles, workspaces) is then set up once, not again in the first unit of every new thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pipelines.extract.units import SampleRow, WorkUnit

    spec = spec_for(tiny_qwen3, tmp_path / "store", token_budget=128, max_length=64)
    worker = ExtractionWorker(spec)
    threads: list[str] = []
    forward = worker._forward

    def recorded(*args: object) -> object:
        threads.append(threading.current_thread().name)
        return forward(*args)

    worker._forward = recorded  # type: ignore[method-assign]
    warm_thread = worker._on_compute_thread(lambda: threading.current_thread().name)
    rng = np.random.default_rng(0)
    units = [
        WorkUnit(u, tuple(
            SampleRow(f"u{u}s{i}", "r", rng.integers(3, 500, 40).astype(np.int32), np.ones(40, np.uint8))
            for i in range(6)
        ))
        for u in range(4)
    ]
    with ThreadPoolExecutor(max_workers=2) as callers:  # two callers at once, as an actor's threads
        results = list(callers.map(worker.run_unit, units))
    worker.close()
    assert [r.num_samples for r in results] == [6, 6, 6, 6]
    assert len(threads) == sum(r.num_batches for r in results) > 4
    assert set(threads) == {warm_thread} and warm_thread.startswith("forwards")


def test_a_warm_up_without_a_temporary_folder_says_which_and_what_to_set(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    worker = ExtractionWorker(spec_for(tiny_qwen3, tmp_path / "store", token_budget=256, max_length=64))
    missing = tmp_path / "no-such-folder"
    monkeypatch.setattr(tempfile, "tempdir", str(missing))
    with pytest.raises(ExtractionError, match=rf"throwaway shard: no temporary folder in {missing}.*TMPDIR"):
        worker.warm_up()
    assert worker.host_buffers._free.qsize() == worker.host_buffers._allocated  # every buffer back
