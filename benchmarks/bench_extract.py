"""Extraction throughput against a bare forward of the same model, on the same batches.

For each model: random token sequences (lengths uniform in [min_length, max_length], seeded) are
cut into work units and length-bucketed batches exactly as ``hsstore extract`` does. Then, on the
same batches:

- bare: ``model.model(input_ids, attention_mask)``: the base model, no hooks, no copies, no writes;
- extract: the extraction worker (hooks on the aux layers and the final norm, the valid tokens
  gathered, device-to-host copies, the shard written through hsstore.ShardWriter on a writer
  thread, each shard committed to a store in ``--store-dir``).

The worker runs in process (pipelines.extract.executors.LocalExecutor): the GPU machine has no
Ray, and an actor runs exactly this code, so this measures what each actor does per GPU.

Models: ``reference`` (examples/reference-target, the real trained weights), ``qwen3-8b`` (the
Qwen3-8B shape: 36 layers, hidden 4096, vocab 151936, random bf16 weights built from a config;
needs a GPU), ``small`` (a 4-layer hidden-256 Qwen3 shape, for a CPU smoke run).

    # GPU (the lent H200):
    python -m benchmarks.bench_extract --models reference,qwen3-8b --out bench_extract.json
    # CPU smoke:
    python -m benchmarks.bench_extract --models small --device cpu --tokens 8192 --out /tmp/b.json

Prints a markdown table; ``--out`` gets the numbers as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import REPO_ROOT, machine_info, run_modes, write_results
from hsstore import FeatureSpec, Lineage, commit_shards
from hsstore.aux_layers import default_aux_layer_ids
from pipelines.extract.batching import collate, padding_waste, plan_batches
from pipelines.extract.executors import LocalExecutor
from pipelines.extract.recipe import UnitsSection
from pipelines.extract.target import load_target
from pipelines.extract.tokenize import TokenizedSample
from pipelines.extract.units import cut_into_units
from pipelines.extract.worker import ExtractionWorker
from pipelines.extract.worker_spec import WorkerSpec

QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=8192,
        max_position_embeddings=4096,
    ),
}


def build_model(name: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    if name == "reference":
        return load_target(str(REPO_ROOT / "examples" / "reference-target"), dtype=str(dtype).split(".")[1], device=device)
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa", **QWEN3_SHAPES[name])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init is N(0, 0.02): keep activations in a realistic range for bf16.
    return model.eval().requires_grad_(False)


def make_samples(num_tokens: int, min_length: int, max_length: int, vocab_size: int, seed: int) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    samples, total = [], 0
    while total < num_tokens:
        length = int(rng.integers(min_length, max_length + 1))
        ids = rng.integers(3, vocab_size, length).astype(np.int32)
        samples.append(TokenizedSample(f"bench-{len(samples):07d}", f"r{len(samples)}", ids, np.ones(length, np.uint8), False))
        total += length
    return samples


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


class ForwardTimeline:
    """CUDA events around each forward, to tell a slower GPU from a starved one.

    Per forward: its GPU time (start to end event on the compute stream), the GPU's idle gap
    before it (the previous forward's end to this one's start: encoding, input copies, and any
    time the GPU waited for the host to launch), the host's time to launch it (the Python call),
    and the host's lead (how long after the call began the GPU started it: near zero, the GPU
    was waiting for the host). Recording events never synchronises; one synchronisation before
    the first forward pins the GPU's clock to the host's. The times are read after the pass.
    """

    def __init__(self) -> None:
        self.events: list[tuple[Any, Any]] = []
        self.launches: list[tuple[float, float]] = []  # host perf_counter at the call, at its return
        self._origin: tuple[float, Any] | None = None

    def wrap(self, forward: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._origin is None:
                torch.cuda.synchronize()
                origin = torch.cuda.Event(enable_timing=True)
                self._origin = (time.perf_counter(), origin)
                origin.record()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            called = time.perf_counter()
            start.record()
            out = forward(*args, **kwargs)
            end.record()
            self.launches.append((called, time.perf_counter()))
            self.events.append((start, end))
            return out

        return timed

    def summary(self) -> dict[str, Any]:
        torch.cuda.synchronize()
        seconds = [start.elapsed_time(end) / 1e3 for start, end in self.events]
        gaps = [prev[1].elapsed_time(cur[0]) / 1e3 for prev, cur in zip(self.events, self.events[1:], strict=False)]
        span = self.events[0][0].elapsed_time(self.events[-1][1]) / 1e3 if self.events else 0.0
        leads, launch = [], []
        if self._origin is not None:
            origin_time, origin = self._origin
            for (called, returned), (start, _) in zip(self.launches, self.events, strict=True):
                leads.append(origin_time + origin.elapsed_time(start) / 1e3 - called)
                launch.append(returned - called)
        return {"forward_seconds": seconds, "gap_seconds": gaps, "gpu_span_seconds": span,
                "forward_total_seconds": sum(seconds), "gap_total_seconds": sum(gaps),
                "host_lead_seconds": leads, "host_launch_seconds": launch,
                "host_lead_median": statistics.median(leads) if leads else None,
                "host_launch_median": statistics.median(launch) if launch else None}


class GpuSampler:
    """``nvidia-smi`` sampling the SM clock and power every 100 ms while a variant runs (a power-
    capped GPU lowers its clock when it does more at once: that shows here, not in a profile)."""

    def __init__(self) -> None:
        import subprocess

        self._proc = None
        with contextlib.suppress(OSError):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )

    def stop(self) -> dict[str, Any]:
        if self._proc is None:
            return {}
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        clocks, power = [], []
        for line in out.splitlines():
            with contextlib.suppress(ValueError):
                clock, watts = (float(x) for x in line.split(",")[:2])
                clocks.append(clock)
                power.append(watts)
        if not clocks:
            return {}
        return {"sm_clock_mhz_median": statistics.median(clocks), "power_w_median": statistics.median(power),
                "samples": len(clocks)}


def bare_forward_seconds(model: torch.nn.Module, units: list[Any], spec: WorkerSpec, device: torch.device, timeline: ForwardTimeline | None = None) -> float:
    """The same batches through ``model.model`` with nothing else.

    Run on a worker thread, as the extraction's forwards are (LocalExecutor's pool): on a loaded
    CPU, torch's intra-op threading behaves differently on the main thread than on others, which
    would skew the comparison (observed: 7x on a 2-core box under load). On a GPU it makes no odds.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_bare_pass, model, units, spec, device, timeline).result()


@torch.inference_mode()
def _bare_pass(model: torch.nn.Module, units: list[Any], spec: WorkerSpec, device: torch.device, timeline: ForwardTimeline | None) -> float:
    forward = timeline.wrap(model.model) if timeline is not None else model.model
    synchronize(device)
    start = time.perf_counter()
    for unit in units:
        token_ids = [row.input_ids for row in unit.rows]
        for batch in plan_batches([len(t) for t in token_ids], spec.token_budget, max_batch_size=spec.max_batch_size, pad_to_multiple_of=spec.pad_to_multiple_of):
            input_ids, mask = collate(token_ids, batch, spec.pad_token_id)
            forward(
                input_ids=to_device(input_ids, device),
                attention_mask=to_device(mask, device) if spec.pass_attention_mask else None,
                use_cache=False,
            )
    synchronize(device)
    return time.perf_counter() - start


class _TimedCapture:
    """The worker's capture with its calls timed; attributes (the worker sets ``on_pace`` per unit)
    read from and written to the capture itself."""

    def __init__(self, capture: Any, timed: Any) -> None:
        object.__setattr__(self, "_capture", capture)
        object.__setattr__(self, "_timed", timed)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._capture, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._capture, name, value)


def extraction_seconds(worker: ExtractionWorker, units: list[Any], spec: WorkerSpec, lineage: Lineage, timeline: ForwardTimeline | None = None) -> tuple[float, list[Any]]:
    """The same units through the extraction worker, each shard committed as it finishes."""
    results: list[Any] = []
    capture = worker.capture
    if timeline is not None:
        worker.capture = _TimedCapture(capture, timeline.wrap(capture))

    def commit(result: Any) -> None:
        commit_shards(spec.store, [result.record], features=list(spec.features), lineage=lineage)
        results.append(result)

    synchronize(worker.device)
    start = time.perf_counter()
    executor = LocalExecutor(spec, worker=worker)
    try:
        executor.run(units, commit)
        synchronize(worker.device)
    finally:
        worker.capture = capture
    return time.perf_counter() - start, results


def compare_timelines(bare: dict[str, Any], extract: dict[str, Any]) -> dict[str, Any]:
    """The two passes' forwards side by side (the same batches in the same order)."""
    pairs = list(zip(bare["forward_seconds"], extract["forward_seconds"], strict=True))
    ratios = [e / b for b, e in pairs if b > 0]
    return {
        "bare": bare,
        "extract": extract,
        "forward_ratio_median": statistics.median(ratios) if ratios else None,
        "forward_ratio_total": extract["forward_total_seconds"] / bare["forward_total_seconds"] if bare["forward_total_seconds"] else None,
        "gap_extra_seconds": extract["gap_total_seconds"] - bare["gap_total_seconds"],
    }


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    model = build_model(name, dtype, device)
    config = model.config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    aux_layer_ids = default_aux_layer_ids(layers)
    features = (
        FeatureSpec(name="aux_hidden_states", shape=(len(aux_layer_ids), hidden), codec=args.codec),
        FeatureSpec(name="final_hidden_state", shape=(hidden,), codec=args.codec),
    )
    store_root = Path(tempfile.mkdtemp(prefix=f"bench-extract-{name}-", dir=args.store_dir))
    spec = WorkerSpec(
        target=name,
        store=str(store_root / "store"),
        features=features,
        aux_layer_ids=tuple(aux_layer_ids),
        device=str(device),
        token_budget=args.token_budget,
        pad_to_multiple_of=8,
        pass_attention_mask=not args.no_attention_mask,
    )
    lineage = Lineage(aux_layer_ids=aux_layer_ids, max_length=args.max_length, code_version="bench")
    samples = make_samples(args.tokens, args.min_length, args.max_length, config.vocab_size, seed=0)
    units = cut_into_units(samples, UnitsSection(max_tokens=args.unit_tokens, max_samples=1 << 30, sort_window_tokens=args.sort_window_tokens))
    # Warm up on the first unit itself: the same shapes (kernels picked, memory pools grown).
    warmup = units[:1]
    worker = ExtractionWorker(spec, model=model)
    try:
        bare_forward_seconds(model, warmup, spec, device)
        warm_spec_units = [type(u)(index=900000 + u.index, rows=u.rows) for u in warmup]
        extraction_seconds(worker, warm_spec_units, spec, lineage)
        bare_runs, extract_runs, results, timelines, clocks = [], [], [], [], []
        timed = args.gpu_timeline and device.type == "cuda"  # CUDA events: nothing to time on the CPU
        for repeat in range(args.repeats):
            bare_timeline = ForwardTimeline() if timed else None
            extract_timeline = ForwardTimeline() if timed else None

            # ABBA order (bare, extract; extract, bare; ...): a drift of the GPU's speed over the
            # run (clocks under the power cap move by a few %) falls on both sides alike.
            for side in ("bare", "extract") if repeat % 2 == 0 else ("extract", "bare"):
                sampler = GpuSampler() if timed else None
                if side == "bare":
                    bare_runs.append(bare_forward_seconds(model, units, spec, device, bare_timeline))
                else:
                    shutil.rmtree(spec.store, ignore_errors=True)
                    seconds, results = extraction_seconds(worker, units, spec, lineage, extract_timeline)
                    extract_runs.append(seconds)
                if sampler is not None:
                    clocks.append({"pass": f"{side}-{repeat}", **sampler.stop()})
            if bare_timeline is not None and extract_timeline is not None:
                timelines.append(compare_timelines(bare_timeline.summary(), extract_timeline.summary()))
        num_tokens = sum(u.num_tokens for u in units)
        unit_batches = [plan_batches([len(r.input_ids) for r in u.rows], spec.token_budget, pad_to_multiple_of=8) for u in units]
        batches = [b for per_unit in unit_batches for b in per_unit]
        store_bytes = sum(r.record.num_bytes for r in results)
        bare_s, extract_s = statistics.median(bare_runs), statistics.median(extract_runs)
        row = {
            "model": name,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": args.dtype,
            "codec": args.codec,
            "num_layers": layers,
            "hidden_size": hidden,
            "aux_layer_ids": aux_layer_ids,
            "num_tokens": num_tokens,
            "num_units": len(units),
            "num_batches": len(batches),
            "token_budget": args.token_budget,
            "padding_waste": padding_waste(batches),
            "bare_seconds": bare_runs,
            "extract_seconds": extract_runs,
            "bare_tokens_per_s": num_tokens / bare_s,
            "extract_tokens_per_s": num_tokens / extract_s,
            "ratio": bare_s / extract_s,
            "ratio_per_repeat": [b / e for b, e in zip(bare_runs, extract_runs, strict=True)],
            "store_bytes_per_token": store_bytes / num_tokens,
            "feature_bytes_per_token": sum(f.raw_bytes_per_token for f in features),
            "write_gb_per_s": store_bytes / extract_s / 1e9,
            "writer_busy_fraction": sum(r.write_seconds for r in results) / extract_s,
            "compute_seconds": sum(r.compute_seconds for r in results),
            "pool_wait_seconds": sum(r.pool_wait_seconds for r in results),
        }
        if timelines:
            row["gpu_timelines"] = timelines
            row["gpu_clocks"] = clocks
            row["batches_per_unit"] = [len(per_unit) for per_unit in unit_batches]
            for t in timelines:
                print(
                    f"  GPU timeline: forwards extract/bare {t['forward_ratio_total']:.4f} (median per batch "
                    f"{t['forward_ratio_median']:.4f}); idle gaps bare {t['bare']['gap_total_seconds']:.3f} s, "
                    f"extract {t['extract']['gap_total_seconds']:.3f} s; host launch per forward (median) bare "
                    f"{t['bare']['host_launch_median']:.4f} s, extract {t['extract']['host_launch_median']:.4f} s; "
                    f"host lead (median) bare {t['bare']['host_lead_median']:.3f} s, extract {t['extract']['host_lead_median']:.3f} s",
                    file=sys.stderr,
                )
    finally:
        worker.close()
        shutil.rmtree(store_root, ignore_errors=True)
        del model, worker
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | device | tokens | padding | bare forward tok/s | extraction tok/s | extraction / bare | store B/token | written GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['dtype']}, {r['codec']}) | {r['device']} | {r['num_tokens']:,} | "
            f"{100 * r['padding_waste']:.1f}% | {r['bare_tokens_per_s']:,.0f} | {r['extract_tokens_per_s']:,.0f} | "
            f"{100 * r['ratio']:.1f}% | {r['store_bytes_per_token']:,.0f} | {r['write_gb_per_s']:.2f} |"
        )
    return "\n".join(lines)


def extract_vs_forward(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="reference,qwen3-8b", help="comma list of reference, qwen3-8b, small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--codec", default="bf16", choices=["bf16", "fp8_e4m3", "float32"])
    parser.add_argument("--tokens", type=int, default=524288, help="tokens per timed pass")
    parser.add_argument("--min-length", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--token-budget", type=int, default=32768, help="padded tokens per forward")
    parser.add_argument("--unit-tokens", type=int, default=262144, help="tokens per work unit (shard), as the recipe default")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sort-window-tokens", type=int, default=None,
                        help="length-sort windows as the recipe's units.sort_window_tokens (4194304 by default there; "
                        "default here: none, units in input order) to plan the batches `hsstore extract` would")
    parser.add_argument("--no-attention-mask", action="store_true", help="right padding without a mask (exact; see the recipe docs)")
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds): how often threads hand over the GIL (Python's default 0.005)")
    parser.add_argument("--gpu-timeline", action="store_true", help="CUDA events around each forward: GPU time per forward and idle gaps, bare vs extract")
    parser.add_argument("--store-dir", default=None, help="where the stores go (default: the temp dir); deleted after each model")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    device = torch.device(args.device)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if device.type != "cuda" and "qwen3-8b" in models:
        parser.error("qwen3-8b needs a CUDA device (16 GB of bf16 weights); use --models small on the CPU")
    if args.max_length > args.token_budget:
        parser.error("--token-budget must be >= --max-length")
    rows = []
    for name in models:
        print(f"benchmarking {name} on {device} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(name, args, device))
    print(markdown(rows))
    if args.out:
        write_results(args.out, {"args": vars(args), "machine": machine_info(), "results": rows})
    return 0


# Modes: ``python -m benchmarks.bench_extract MODE --help``; without a mode, :func:`extract_vs_forward` runs.
MODES = {
    "ray": "benchmarks.extract.through_ray",
    "ray-report": "benchmarks.extract.ray_report",
    "gpu-limit": "benchmarks.extract.gpu_limit",
    "dry-run-memory": "benchmarks.extract.dry_run_memory",
    "trace": "benchmarks.extract.trace_head",
    "cluster": "benchmarks.extract.cluster",
}


def main(argv: list[str] | None = None) -> int:
    return run_modes(argv, extract_vs_forward, MODES, prog="python -m benchmarks.bench_extract")


if __name__ == "__main__":
    sys.exit(main())
