"""What a device-to-host copy beside a forward costs the forward, variant by variant, interleaved.

The extraction's forwards take 2-5% longer on the GPU than a bare forward of the same batches
(RESULTS.md, issue 13), by 20-50 ms per 32k-token batch with no idle gap between forwards, and
an earlier profile found that the copies of the features cost about their own duration whether
they overlap the next forward or not. This probe measures that in isolation: one 8B-shape model,
one batch shape, and before each forward a copy of the size a batch's features have, issued on a
side stream after the previous forward (as ShardSink does). The variants take turns forward by
forward (round robin), so a drift of the GPU's clocks falls on all of them alike:

- ``none``: the forward alone (the yardstick);
- ``d2h``: a copy of the previous batch's features (bf16: tokens x 4 x hidden x 2 bytes) into
  pinned host memory on a side stream (PCIe, device to host);
- ``d2h_half``: half those bytes (what fp8 copies);
- ``h2d``: the same bytes host to device (PCIe, the other direction);
- ``d2d``: the same bytes device to device on the side stream (copy engine or SMs, no PCIe);
- ``d2h_host_busy``: ``d2h`` while four host threads checksum another pinned buffer (the writer
  threads' memory traffic on the host);
- ``d2h_serial``: the copy on the compute stream after the forward, timed with it (no overlap);
- ``d2h_paced<N>``: the ``d2h`` bytes in ``N`` equal pieces, one issued as every (layers / N)-th
  decoder layer starts (a forward pre-hook records an event there; the piece waits for it), so
  the link is busy in short bursts spread over the forward instead of one 20 ms burst;
- ``capture``: the extraction's HiddenStateCapture instead of the bare forward (hooks on three aux
  layers and the final norm, the valid tokens gathered and stacked), no copy; ``capture_d2h`` and
  ``capture_d2h_paced4``: with the copy as one burst or in 4 paced pieces (what the worker does);
- ``graph_none`` / ``graph_d2h``: the forward captured once as a CUDA graph and replayed, alone and
  beside the ``d2h`` copy. A graph's kernels are launched from the device, not fetched one by one
  from the host's command buffer over PCIe: if ``d2h`` slows an eager forward but not a graph,
  the copy delays the launches, not the kernels.

Per variant: the median GPU time of the forward (CUDA events on the compute stream) and its
excess over ``none`` in ms and %, plus the copies' own GPU time and GB/s.

    python -m benchmarks.investigations.profile_copy_contention --out $OUT/copy-contention.json      # GPU
    python -m benchmarks.investigations.profile_copy_contention --shape small --rows 2 --length 256 --cycles 2  # CUDA-less smoke: refuses
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("none", "d2h", "d2h_half", "h2d", "d2d", "d2h_host_busy", "d2h_serial", "d2h_paced4", "d2h_paced12",
            "d2h_paced36", "capture", "capture_d2h", "capture_d2h_paced4", "graph_none", "graph_d2h")
FEATURE_VECTORS = 4  # three aux layers and the final state, as the benchmark's recipe stores


class HostLoad:
    """Threads that checksum a pinned buffer in a loop while set (crc32c releases the GIL)."""

    def __init__(self, buffer: torch.Tensor, threads: int = 4) -> None:
        import crc32c

        self.on = threading.Event()
        self.stop = threading.Event()
        view = memoryview(buffer.numpy()).cast("B")  # each thread hashes all of it

        def work() -> None:
            while not self.stop.is_set():
                if self.on.wait(0.05):
                    crc32c.crc32c(view)

        self.threads = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--cycles", type=int, default=6, help="rounds of every variant (the first is a warm-up)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset, in this order")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_copy_contention needs a CUDA device")
    from benchmarks.bench_extract import build_model

    device = torch.device("cuda")
    model = build_model(args.shape, torch.bfloat16, device)
    hidden = model.config.hidden_size
    tokens = args.rows * args.length
    feature_bytes = tokens * FEATURE_VECTORS * hidden * 2
    ids = torch.randint(3, model.config.vocab_size, (args.rows, args.length), device=device)
    source = torch.empty(feature_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    device_target = torch.empty_like(source)
    pinned = torch.empty(feature_bytes, dtype=torch.uint8, pin_memory=True)
    pinned_src = torch.empty(feature_bytes, dtype=torch.uint8, pin_memory=True).fill_(7)
    busy_buffer = torch.empty(feature_bytes, dtype=torch.uint8, pin_memory=True).fill_(3)
    host_load = HostLoad(busy_buffer)
    side = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)
    forward_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    copy_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def side_copy(target: torch.Tensor, data: torch.Tensor) -> tuple[Any, Any]:
        """``target.copy_(data)`` on the side stream after what the compute stream has queued so
        far; returns its timing events."""
        ready = torch.cuda.Event()
        ready.record(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            start.record(side)
            target.copy_(data, non_blocking=True)
            end.record(side)
        return start, end

    # The side-stream copy a variant puts beside its forward (after the previous forward).
    copies = {
        "d2h": (pinned, source), "d2h_host_busy": (pinned, source), "graph_d2h": (pinned, source),
        "capture_d2h": (pinned, source), "d2h_half": (pinned[: feature_bytes // 2], source[: feature_bytes // 2]),
        "h2d": (device_target, pinned_src), "d2d": (device_target, source),
    }

    def issue_copy(variant: str) -> tuple[Any, Any] | None:
        return side_copy(*copies[variant]) if variant in copies else None

    layers = model.model.layers
    paced = {"pieces": 0, "events": []}

    def pace_hook(index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            pieces = paced["pieces"]
            if not pieces or index % (len(layers) // pieces) or index // (len(layers) // pieces) >= pieces:
                return
            piece = index // (len(layers) // pieces)
            rows = slice(piece * (feature_bytes // pieces), (piece + 1) * (feature_bytes // pieces))
            paced["events"].append(side_copy(pinned[rows], source[rows]))

        return hook

    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(pace_hook(index))

    from pipelines.extract.capture import HiddenStateCapture

    capture = HiddenStateCapture(model, [2, model.config.num_hidden_layers // 2, model.config.num_hidden_layers - 3],
                                 pass_attention_mask=False)
    mask = torch.ones_like(ids)
    valid = torch.arange(ids.numel(), device=device)
    wanted = args.variants.split(",")
    graph = None
    if any(v.startswith("graph") for v in wanted):
        with torch.inference_mode():
            try:  # warm up on a side stream first, as CUDA graph capture asks
                with torch.cuda.stream(side):
                    model.model(input_ids=ids, use_cache=False)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model.model(input_ids=ids, use_cache=False)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - the graph variants are optional
                print(f"no CUDA graph of the forward ({type(err).__name__}: {err}); graph variants skipped", file=sys.stderr)
                graph = None
    variants = [v for v in VARIANTS if v in wanted and (graph is not None or not v.startswith("graph"))]
    forward_ms = {v: forward_ms[v] for v in variants}

    with torch.inference_mode():
        for cycle in range(args.cycles):
            timed: list[tuple[str, Any, Any, list[Any], Any]] = []
            for variant in variants:
                # No synchronisation between forwards (the worker's host runs ~0.5 s ahead of the
                # GPU); only the host-load variant needs its threads busy while its forward runs.
                if variant == "d2h_host_busy":
                    torch.cuda.synchronize()
                    host_load.on.set()
                    time.sleep(0.05)
                copy_events = issue_copy(variant)
                paced["pieces"] = int(variant.split("paced")[1]) if "paced" in variant else 0
                paced["events"] = []
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(compute)
                if variant.startswith("graph"):
                    graph.replay()
                elif variant.startswith("capture"):
                    capture(ids, mask, valid)
                else:
                    model.model(input_ids=ids, use_cache=False)
                if variant == "d2h_serial":
                    serial_start = torch.cuda.Event(enable_timing=True)
                    serial_start.record(compute)
                    pinned.copy_(source, non_blocking=True)
                    copy_events = (serial_start, None)
                end.record(compute)
                if variant == "d2h_host_busy":
                    torch.cuda.synchronize()
                    host_load.on.clear()
                timed.append((variant, start, end, paced["events"], copy_events))
            torch.cuda.synchronize()
            if cycle == 0:
                continue  # warm-up round
            for variant, start, end, pieces, copy_events in timed:
                forward_ms[variant].append(start.elapsed_time(end))
                if pieces:  # the pieces' summed GPU time
                    copy_ms[variant].append(sum(a.elapsed_time(b) for a, b in pieces))
                if copy_events is not None:
                    copy_start, copy_end = copy_events
                    copy_ms[variant].append(copy_start.elapsed_time(copy_end if copy_end is not None else end))
    host_load.close()
    base = statistics.median(forward_ms["none"])
    graph_base = statistics.median(forward_ms["graph_none"]) if "graph_none" in forward_ms else None
    rows = []
    for variant in variants:
        median = statistics.median(forward_ms[variant])
        copy = statistics.median(copy_ms[variant]) if copy_ms[variant] else None
        moved = feature_bytes // 2 if variant == "d2h_half" else feature_bytes
        rows.append({
            "variant": variant,
            "forward_ms_median": median,
            "forward_ms": forward_ms[variant],
            # Against the same kind of forward: eager variants against none, graphs against graph_none.
            "excess_ms": median - (graph_base if variant.startswith("graph") else base),
            "excess_pct": 100 * (median / (graph_base if variant.startswith("graph") else base) - 1),
            "copy_ms_median": copy,
            "copy_gb_per_s": moved / copy / 1e6 if copy else None,
        })
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "shape": args.shape,
        "batch": [args.rows, args.length],
        "feature_bytes_per_batch": feature_bytes,
        "cycles_measured": args.cycles - 1,
        "variants": rows,
    }
    print("| variant | forward ms (median) | excess ms | excess % | copy ms | copy GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        copy = f"{r['copy_ms_median']:.1f}" if r["copy_ms_median"] else ""
        rate = f"{r['copy_gb_per_s']:.1f}" if r["copy_gb_per_s"] else ""
        print(f"| {r['variant']} | {r['forward_ms_median']:.1f} | {r['excess_ms']:+.1f} | {r['excess_pct']:+.2f} | {copy} | {rate} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
