"""Where a worker's per-batch path loses time against a bare forward: the same batches, cumulative
variants, one process, one GPU.

1. ``bare``: ``model.model(input_ids)``, no mask, nothing else (the benchmark's yardstick);
2. ``capture``: the worker's HiddenStateCapture (hooks, the valid tokens gathered), features dropped;
3. ``copy``: plus encoding on the device and the device-to-host copies into the pinned pool on the
   side stream (a thread waits for each copy and frees the buffers; nothing is written);
   ``copy-serial``: the same copies on the compute stream, after the forward (nothing overlaps);
4. ``worker-<codec>``: the ExtractionWorker's whole ``run_unit`` (the shard written to ``--store-dir``),
   once per codec;
5. ``worker-bf16-shm``: the same to /dev/shm (no disk), when it exists.

Each variant runs every batch after one warm-up unit; tokens/s are the real tokens over the
variant's wall time (synchronised). On CUDA each variant also reports its GPU timeline (CUDA events
around every forward: the forwards' GPU time and the idle gaps between them; see
``bench_extract.ForwardTimeline``), the copies' GPU time, and the SM clock and power that
``nvidia-smi`` sampled while it ran: a forward that takes longer on the GPU with no gaps is slowed
on the device (contention, clocks), not starved by the host. ``--profile DIR`` writes a torch.profiler table of two units of
the bf16 worker.


    python -m benchmarks.investigations.profile_extract_batch --shape qwen3-8b --tokens 524288 --out $OUT/profile-extract.json
    python -m benchmarks.investigations.profile_extract_batch --shape small --device cpu --tokens 16384   # smoke
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_extract import (
    ForwardTimeline,
    GpuSampler,
    build_model,
    make_samples,
    to_device,
)
from benchmarks.bench_extract import synchronize as sync
from benchmarks.common import write_results
from hsstore import FeatureSpec
from hsstore.format.codecs import encode_torch
from pipelines.extract.batching import collate, plan_batches
from pipelines.extract.capture import HiddenStateCapture
from pipelines.extract.recipe import UnitsSection
from pipelines.extract.sink import HostBufferPool
from pipelines.extract.units import SampleRow, WorkUnit, cut_into_units
from pipelines.extract.worker import ExtractionWorker
from pipelines.extract.worker_spec import WorkerSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "small"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=524288)
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--unit-tokens", type=int, default=262144)
    parser.add_argument("--store-dir", default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args.shape, torch.bfloat16, device)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    aux = [2, layers // 2, layers - 3]
    samples = make_samples(args.tokens + 2 * args.unit_tokens, 1024, 2048, model.config.vocab_size, seed=0)
    units = [
        WorkUnit(u.index, tuple(SampleRow(r.sample_id, r.sample_id, r.input_ids, r.loss_mask) for r in u.rows))
        for u in cut_into_units(samples, UnitsSection(max_tokens=args.unit_tokens, max_samples=1 << 30, sort_window_tokens=None))
    ]
    warm, timed = units[:1], units[1:]
    batches = [(u, b) for u in timed for b in plan_batches([len(r.input_ids) for r in u.rows], args.token_budget, pad_to_multiple_of=8)]
    num_tokens = sum(b.num_tokens for _, b in batches)
    capture = HiddenStateCapture(model, aux, pass_attention_mask=False)

    def features_of(codec: str) -> tuple[FeatureSpec, ...]:
        return (FeatureSpec(name="aux_hidden_states", shape=(len(aux), hidden), codec=codec),
                FeatureSpec(name="final_hidden_state", shape=(hidden,), codec=codec))

    cuda = device.type == "cuda"
    timeline: ForwardTimeline | None = None  # the running variant's
    copy_events: list[tuple[Any, Any]] = []

    @torch.inference_mode()
    def bare(items: list[Any]) -> None:
        forward = timeline.wrap(model.model) if timeline is not None else model.model
        for unit, batch in items:
            ids, _ = collate([r.input_ids for r in unit.rows], batch, 0)
            forward(input_ids=to_device(ids, device), use_cache=False)

    @torch.inference_mode()
    def captured(items: list[Any], copy: bool, serial: bool = False) -> None:
        forward = timeline.wrap(capture) if timeline is not None else capture
        pool = HostBufferPool(features_of("bf16"), args.token_budget, 5, pin=device.type == "cuda")
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        done_q: queue.Queue[Any] = queue.Queue(maxsize=3)

        def drain() -> None:
            while (item := done_q.get()) is not None:
                event, buffers = item
                if event is not None:
                    event.synchronize()
                pool.release(buffers)

        thread = threading.Thread(target=drain)
        thread.start()
        for unit, batch in items:
            ids, mask = collate([r.input_ids for r in unit.rows], batch, 0)
            valid = to_device(np.flatnonzero(mask.reshape(-1)), device)
            feats = forward(to_device(ids, device), to_device(mask, device), valid)
            if not copy:
                continue
            encoded: dict[str, torch.Tensor] = {}
            for spec in features_of("bf16"):
                encoded.update(encode_torch(spec, feats[spec.name]))
            buffers = pool.acquire(batch.num_tokens)
            event = None
            if stream is not None and serial:
                start, event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for name, bits in encoded.items():
                    buffers[name][: batch.num_tokens].copy_(bits, non_blocking=True)
                event.record()
                copy_events.append((start, event))
            elif stream is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    for name, bits in encoded.items():
                        buffers[name][: batch.num_tokens].copy_(bits, non_blocking=True)
                        bits.record_stream(stream)
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(stream)
                    copy_events.append((start, event))
            done_q.put((event, buffers))
        done_q.put(None)
        thread.join()

    def worker_run(items_units: list[WorkUnit], codec: str, store_dir: str | None) -> Any:
        root = Path(tempfile.mkdtemp(prefix="profile-extract-", dir=store_dir))
        spec = WorkerSpec(target="bench", store=str(root / "store"), features=features_of(codec), aux_layer_ids=tuple(aux),
                          device=str(device), token_budget=args.token_budget, pass_attention_mask=False)
        worker = ExtractionWorker(spec, model=model)
        own_capture = worker.capture
        if timeline is not None:
            worker.capture = timeline.wrap(own_capture)
        try:
            results = [worker.run_unit(u) for u in items_units]
        finally:
            worker.capture = own_capture
            worker.close()
            shutil.rmtree(root, ignore_errors=True)
        return results

    variants: dict[str, Any] = {
        "bare": lambda: bare(batches),
        "capture": lambda: captured(batches, copy=False),
        "copy": lambda: captured(batches, copy=True),
        "copy-serial": lambda: captured(batches, copy=True, serial=True),
        "worker-bf16": lambda: worker_run(timed, "bf16", args.store_dir),
        "worker-fp8_e4m3": lambda: worker_run(timed, "fp8_e4m3", args.store_dir),
    }
    store_bytes = 2 * num_tokens * (len(aux) + 1) * hidden * 2  # a bf16 store, with room to spare
    if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > store_bytes:
        variants["worker-bf16-shm"] = lambda: worker_run(timed, "bf16", "/dev/shm")
    warm_batches = [(u, b) for u in warm for b in plan_batches([len(r.input_ids) for r in u.rows], args.token_budget, pad_to_multiple_of=8)]
    bare(warm_batches)
    captured(warm_batches, copy=True)
    worker_run(warm, "bf16", args.store_dir)
    rows: dict[str, Any] = {}
    for name, run in [*variants.items(), ("bare-again", variants["bare"])]:
        timeline = ForwardTimeline() if cuda else None
        copy_events.clear()
        sampler = GpuSampler() if cuda else None
        sync(device)
        start = time.perf_counter()
        results = run()
        sync(device)
        seconds = time.perf_counter() - start
        rows[name] = {"seconds": round(seconds, 3), "tokens_per_s": round(num_tokens / seconds)}
        if timeline is not None:
            gpu = timeline.summary()
            rows[name]["gpu_forward_seconds"] = round(gpu["forward_total_seconds"], 3)
            rows[name]["gpu_gap_seconds"] = round(gpu["gap_total_seconds"], 4)
            rows[name]["gpu_forward_each"] = [round(x, 4) for x in gpu["forward_seconds"]]
        if copy_events:
            rows[name]["gpu_copy_seconds"] = round(sum(a.elapsed_time(b) for a, b in copy_events) / 1e3, 3)
        if sampler is not None:
            rows[name].update(sampler.stop())
        timeline = None
        if isinstance(results, list):
            rows[name]["compute_seconds"] = round(sum(r.compute_seconds for r in results), 3)
            rows[name]["writer_busy_seconds"] = round(sum(r.write_seconds for r in results), 3)
            rows[name]["copy_wait_seconds"] = round(sum(r.copy_wait_seconds for r in results), 3)
        print(name, json.dumps(rows[name]), flush=True)
    reference = (rows["bare"]["tokens_per_s"] + rows["bare-again"]["tokens_per_s"]) / 2
    for row in rows.values():
        row["vs_bare"] = round(row["tokens_per_s"] / reference, 4)
    if cuda:
        gpu_reference = (rows["bare"]["gpu_forward_seconds"] + rows["bare-again"]["gpu_forward_seconds"]) / 2
        for name, row in rows.items():
            row["gpu_forward_vs_bare"] = round(row["gpu_forward_seconds"] / gpu_reference, 4)
            print(f"{name:18s} wall {row['vs_bare']:.4f} of bare, GPU forwards {row['gpu_forward_vs_bare']:.4f} x bare's, "
                  f"gaps {row['gpu_gap_seconds']:.3f} s, copies {row.get('gpu_copy_seconds', 0):.3f} s, "
                  f"SM {row.get('sm_clock_mhz_median')} MHz, {row.get('power_w_median')} W", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            worker_run(timed[:2], "bf16", args.store_dir)
            sync(device)
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60)
        (Path(args.profile) / "profile-extract-worker.txt").write_text(table)
    out = {"shape": args.shape, "num_tokens": num_tokens, "num_batches": len(batches), "variants": rows,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    print(json.dumps(out, indent=1))
    if args.out:
        write_results(args.out, out, indent=1)
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
