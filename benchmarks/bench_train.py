"""Training from the store vs "online" training, the loader's data wait, and bf16 vs fp8 stores.

In one run:

1. **Throughput** (per target shape): the trainer's own draft step (``pipelines.train.trainer``'s
   ``build_draft`` and ``build_objective``, ``objective_loss``: teacher from the final state, 7-step
   TTT unroll, AdamW; :func:`throughput` below) fed two ways:
   - *store*: packed batches streamed by ``hsstore.loader.StreamingLoader`` and decoded on the device;
   - *online*: the target runs inside the step on the same packed rows (each row's documents as a
     padded batch, hooks capture the aux and final states: what SpecForge's and Quark's online modes
     do), then the identical draft step.
   Reported: training tokens/s (real tokens, padding excluded) and the fraction of step time the
   store path spent waiting for data.
2. **Codec quality** (reference target only: its weights are real): two stores from the same records,
   bf16 and fp8 (e4m3, per-token scales); the same recipe trained for the same steps (the same
   samples in the same order: lengths are identical, so the plans are) on each; per-depth accuracy
   of both drafts measured on a held-out bf16 store.

Shapes: ``reference`` (examples/reference-target, real weights, real records) and ``qwen3-8b``
(Qwen3-8B's config with random bf16 weights, random token ids; CUDA only: 16 GB of weights).

    python -m benchmarks.bench_train --quick                      # CPU smoke, minutes
    python -m benchmarks.bench_train --device cuda --out bench_train_h200.json   # lent H200

Prints a markdown table; ``--out`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hsstore
from benchmarks.common import REPO_ROOT, run_modes, write_results
from hsstore.loader import StreamingLoader
from hsstore.torch_data import DeviceBatch, WaitTimer, to_device
from pipelines.train.config import TrainRecipe

REFERENCE_TARGET = REPO_ROOT / "examples" / "reference-target"
TRAIN_DATA = Path(os.environ.get("HSSTORE_TRAIN_DATA", REPO_ROOT.parent / "shared" / "data" / "draft_train.jsonl"))
QWEN3_8B = dict(  # Qwen/Qwen3-8B config.json
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
)


# -- stores ------------------------------------------------------------------------------------


def extract_reference(store: Path, records: Path, limit: int, max_length: int, codec: str, device: str,
                      skip: int = 0) -> None:
    """The project's extraction (in process) over records [skip, skip + limit)."""
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    data = records
    if skip:
        data = store.parent / f"{store.name}.jsonl"
        data.write_text("".join(records.read_text().splitlines(keepends=True)[skip : skip + limit]))
    dtype = "float32" if device == "cpu" else "bfloat16"
    run_extraction(build_recipe(ExtractRecipe, {
        "target": str(REFERENCE_TARGET), "data": [str(data)], "store": str(store), "limit": limit,
        "executor": "local", "model": {"dtype": dtype, "device": device},
        "codecs": {"aux_hidden_states": {"codec": codec}, "final_hidden_state": {"codec": codec}},
        "batching": {"max_length": max_length, "too_long": "truncate", "token_budget": max(8 * max_length, 16384)},
    }))


def random_target(workdir: Path, device: torch.device) -> tuple[Any, Path]:
    """Qwen3-8B-shaped model with random bf16 weights, plus a directory holding its config and only
    the tensors the trainer reads (embed_tokens, final norm, lm_head)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_8B, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: 16 GB, not 32 GB of float32 first
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    target_dir = workdir / "qwen3-8b-random"
    target_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(target_dir)
    save_file({
        "model.embed_tokens.weight": model.model.embed_tokens.weight.detach().cpu().contiguous(),
        "model.norm.weight": model.model.norm.weight.detach().cpu().contiguous(),
        "lm_head.weight": model.lm_head.weight.detach().cpu().contiguous(),
    }, str(target_dir / "model.safetensors"))
    return model, target_dir


def extract_random(model: Any, target_dir: Path, store: Path, num_tokens: int, max_length: int, seed: int = 0) -> None:
    """Random token sequences through the in-memory target, captured like extraction does."""
    from pipelines import target_identity as ti
    from pipelines.extract.capture import HiddenStateCapture

    cfg = model.config
    aux = [2, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 3]
    lineage = hsstore.Lineage(target=ti.identity_model(target_dir), aux_layer_ids=aux, max_length=max_length)
    specs = [hsstore.FeatureSpec(name="aux_hidden_states", shape=(len(aux), cfg.hidden_size)),
             hsstore.FeatureSpec(name="final_hidden_state", shape=(cfg.hidden_size,))]
    rng = np.random.default_rng(seed)
    device = next(model.parameters()).device
    written = 0
    with HiddenStateCapture(model, aux) as capture, hsstore.StoreWriter(str(store), specs, lineage, shard_max_tokens=1 << 16) as writer:
        while written < num_tokens:
            length = int(rng.integers(max_length // 4, max_length + 1))
            ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=(1, length))).to(device)
            features = capture(ids, torch.ones_like(ids))
            writer.add_sample(sample_id=f"rand-{written}", source_id=f"rand-{written}", input_ids=ids[0].cpu().numpy(),
                              loss_mask=np.ones(length), features=features)
            written += length


# -- the two ways to feed the step --------------------------------------------------------------


def make_recipe(store: Path, target: Path, out: Path, args: argparse.Namespace, **extra: Any) -> TrainRecipe:
    data: dict[str, Any] = {
        "store": str(store), "target": str(target), "output_dir": str(out), "device": args.device,
        "draft": {"vocab": {"draft_vocab_size": args.draft_vocab}},
        "loader": {"token_budget": args.token_budget, "shuffle_window": 256, "read_threads": args.read_threads,
                   "rows_per_batch": args.rows},
        "optimizer": {"lr": args.lr}, "schedule": {"warmup_steps": max(1, args.steps // 10)},
        "log_every": max(1, args.steps // 5), "seed": 0,
    }
    data.update(extra)
    return TrainRecipe.model_validate(data)


class OnlineFeatures:
    """Runs the target on a packed row's documents (a padded batch) and scatters the captured
    states back into the packed layout: the online alternative to reading the store."""

    def __init__(self, model: Any, aux_layer_ids: list[int]) -> None:
        from pipelines.extract.capture import HiddenStateCapture

        self.capture = HiddenStateCapture(model, aux_layer_ids)
        self.device = next(model.parameters()).device

    def __call__(self, batch: DeviceBatch) -> dict[str, torch.Tensor]:
        B, T = batch.input_ids.shape
        docs, index = [], []
        for b, lengths in enumerate(batch.doc_lengths):
            start = 0
            for length in lengths:
                docs.append(batch.input_ids[b, start : start + length])
                index.append(b * T + torch.arange(start, start + length, device=self.device))
                start += length
        longest = max(len(d) for d in docs)
        ids = torch.zeros(len(docs), longest, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, doc in enumerate(docs):
            ids[i, : len(doc)], mask[i, : len(doc)] = doc, 1
        captured = self.capture(ids, mask)
        flat_index = torch.cat(index)
        out = {}
        for name, values in captured.items():
            full = torch.zeros(B * T, *values.shape[1:], dtype=values.dtype, device=self.device)
            full[flat_index] = values
            out[name] = full.reshape(B, T, *values.shape[1:])
        return out


def throughput(recipe: TrainRecipe, steps: int, warmup: int, online_model: Any | None) -> dict[str, float]:
    """Tokens/s of ``steps`` training steps (after ``warmup``), fed from the store or online: the
    trainer's own objective, loss and optimizer (``pipelines.train.trainer``), one GPU."""
    from pipelines.train.distributed import Distributed
    from pipelines.train.lineage_check import choose_teacher
    from pipelines.train.objective import objective_loss
    from pipelines.train.target_heads import load_target_heads
    from pipelines.train.trainer import build_draft, build_objective

    device = torch.device(recipe.device)
    store = hsstore.open_store(recipe.store)
    heads = load_target_heads(recipe.target, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16).to(device)
    torch.manual_seed(0)
    draft = build_draft(recipe, store, heads, Path(recipe.output_dir), is_main=True).to(device)
    draft.embed_tokens.weight.requires_grad_(False)
    teacher = choose_teacher(store, "auto")
    objective = build_objective(recipe, draft, teacher, heads, device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.optimizer.lr, fused=device.type == "cuda")
    # Online reads only token ids and packing metadata: the target computes the features.
    features = ["aux_hidden_states", "final_hidden_state"] if online_model is None else []
    loader = StreamingLoader(store, features, token_budget=recipe.loader.token_budget, seed=0,
                             rows_per_batch=recipe.loader.rows_per_batch,
                             shuffle_window=recipe.loader.shuffle_window, read_threads=recipe.loader.read_threads)
    timer = WaitTimer(loader.batches())
    online = OnlineFeatures(online_model, list(store.lineage.aux_layer_ids)) if online_model is not None else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    dist_state = Distributed(device=device)
    tokens = 0
    wait = 0.0
    started = 0.0
    scored = torch.zeros(recipe.ttt_length, dtype=torch.float64, device=device)
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            started, tokens, wait = time.perf_counter(), 0, 0.0
        host = next(timer)
        wait += timer.last_wait
        batch = to_device(host, loader.specs, device, pin_memory=device.type == "cuda")
        if online is not None:
            with torch.no_grad():
                batch.features = online(batch)  # replaces the (unused) aux read with the target's forward
        if device.type == "cpu":
            batch.features = {k: v.float() for k, v in batch.features.items()}
        with autocast:
            out = objective(batch.features, batch.input_ids, batch.position_ids, batch.loss_mask, batch.doc_ids)
        counts = torch.stack(out.counts).to(torch.float64)
        objective_loss(out, counts, recipe.loss_decay, False, dist_state.world_size).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch.num_real_tokens
        if step >= warmup:
            scored += counts
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    result = {"tokens_per_s": tokens / elapsed, "data_wait_frac": wait / elapsed, "tokens": tokens, "seconds": elapsed,
              "scored_fraction": float(scored.mean()) / max(tokens, 1)}
    if device.type == "cuda":
        from benchmarks.train.profile_step import step_flops_per_token

        flops = step_flops_per_token(draft.config, recipe.ttt_length, result["scored_fraction"]) * tokens
        result["model_tflops"] = flops / elapsed / 1e12
        result["mfu"] = result["model_tflops"] / 989.0  # the H100/H200 dense bf16 datasheet rate
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def ddp_throughput(store: Path, target: Path, workdir: Path, args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    """``torchrun --nproc_per_node gpus -m pipelines.cli train``: the real trainer, steady tokens/s
    as the median of its log windows after the first (compilation and warmup)."""
    import subprocess

    out = workdir / f"ddp-{gpus}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f"store={store}", f"target={target}", f"output_dir={out}", "device=cuda", f"max_steps={args.ddp_steps}",
        f"loader.token_budget={args.token_budget}", "loader.shuffle_window=256", "log_every=5", "verify_weights=false",
        f"draft.vocab.draft_vocab_size={args.draft_vocab}", "schedule.warmup_steps=5",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m", "pipelines.cli", "train",
               str(REPO_ROOT / "recipes" / "qwen3" / "qwen3-8b-eagle3-train.yaml")]
    for item in overrides:
        command += ["--set", item]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=args.ddp_timeout)
    if proc.returncode != 0:
        return {"gpus": gpus, "error": proc.stderr[-3000:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = sorted(r["tokens_per_s"] for r in records[1:]) or [records[-1]["tokens_per_s"]]
    summary = json.loads((out / "summary.json").read_text())
    waits = sorted(r["data_wait_frac"] for r in records[1:]) or [records[-1]["data_wait_frac"]]
    return {"gpus": gpus, "tokens_per_s_steady": steady[len(steady) // 2], "tokens_per_s_run": summary["tokens_per_s"],
            "data_wait_frac_steady": waits[len(waits) // 2],
            "data_wait_frac": summary["data_wait_frac"], "steps": summary["steps"], "wall_s": time.perf_counter() - started,
            "windows": [round(r["tokens_per_s"]) for r in records]}


# -- codec quality ------------------------------------------------------------------------------


@torch.no_grad()
def held_out_accuracy(checkpoint: Path, eval_store: Path, token_budget: int, device: torch.device) -> list[float]:
    """Per-depth accuracy of a trained draft over every batch of a held-out store."""
    from pipelines.models.checkpoint import load_draft
    from pipelines.train.target_heads import load_target_heads
    from pipelines.train.teacher import build_teacher
    from pipelines.train.ttt import ttt_forward

    draft = load_draft(checkpoint, device=device).eval()
    heads = load_target_heads(REFERENCE_TARGET, dtype=torch.float32).to(device)
    loader = StreamingLoader(str(eval_store), ["aux_hidden_states", "final_hidden_state"],
                             token_budget=token_budget, shuffle_window=1)
    correct = torch.zeros(7, dtype=torch.float64)
    count = torch.zeros(7, dtype=torch.float64)
    for host in loader.batches(max_epochs=1):
        batch = to_device(host, loader.specs, device)
        feats = {k: v.float() for k, v in batch.features.items()}
        teacher = build_teacher("final_hidden", feats, d2t=draft.d2t, t2d=draft.t2d, lm_head_VH=heads.lm_head_VH)
        out = ttt_forward(draft, feats["aux_hidden_states"], batch.input_ids, batch.position_ids, batch.loss_mask,
                          teacher.probs_BTV, teacher.valid_BT, batch.doc_ids)
        correct += torch.stack(out.step_correct).double().cpu()
        count += torch.stack(out.step_counts).double().cpu()
    return [round(float(c / max(n, 1)), 4) for c, n in zip(correct, count, strict=True)]


class _SkipQuality(Exception):
    pass


# -- main ---------------------------------------------------------------------------------------


def store_vs_online(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CPU smoke: few records, short sequences, few steps")
    parser.add_argument("--shapes", nargs="+", default=None, help="reference and/or qwen3-8b (default: both on CUDA)")
    parser.add_argument("--records", type=int, default=None, help="reference records to extract for training")
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per throughput measurement")
    parser.add_argument("--quality-steps", type=int, default=None, help="training steps per codec")
    parser.add_argument("--draft-vocab", type=int, default=None)
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workdir", default=None, help="keep stores here (default: a temp dir, removed)")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    parser.add_argument("--rows", type=int, default=1, help="packed rows per step")
    parser.add_argument("--modes", nargs="+", default=["store", "online"], help="store and/or online")
    parser.add_argument("--skip-quality", action="store_true", help="skip the bf16-vs-fp8 held-out accuracy part")
    parser.add_argument("--ddp-gpus", nargs="*", type=int, default=[], help="torchrun the qwen3-8b trainer on these GPU counts")
    parser.add_argument("--ddp-steps", type=int, default=40)
    parser.add_argument("--ddp-timeout", type=int, default=300)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    quick = args.quick or not cuda
    args.records = args.records or (24 if quick else 400)
    args.max_length = args.max_length or (256 if quick else 2048)
    # The TTT attention masks are [T, (depth + 1) * T]: 8192 keeps depth 7 within a few GB.
    args.token_budget = args.token_budget or (512 if quick else 8192)
    args.steps = args.steps or (6 if quick else 20)
    args.quality_steps = args.quality_steps or (20 if quick else 600)
    args.draft_vocab = args.draft_vocab or 2048
    shapes = args.shapes or (["reference", "qwen3-8b"] if cuda else ["reference"])
    device = torch.device(args.device)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-train-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "throughput": {}}
    try:
        extract_device = "cuda" if cuda else "cpu"
        ref_bf16 = workdir / "ref-bf16"
        needs_reference = "reference" in shapes or not args.skip_quality
        if needs_reference and not ref_bf16.exists():  # the reference shape's store and the bf16 side of the codec comparison
            extract_reference(ref_bf16, TRAIN_DATA, args.records, args.max_length, "bf16", extract_device)
        for shape in shapes:
            if shape == "reference":
                from transformers import AutoModelForCausalLM

                target_dir, store = REFERENCE_TARGET, ref_bf16
                dtype = torch.bfloat16 if cuda else torch.float32
                model = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=dtype).to(device).eval()
            elif shape == "qwen3-8b":
                model, target_dir = random_target(workdir, device)
                store = workdir / "qwen3-8b-bf16"
                if not store.exists():
                    # Enough for warmup + timed steps, and for every rank of the DDP runs
                    # (bf16 aux + final: 32 KB/token at this shape).
                    steps_needed = max(args.steps + 4, max(args.ddp_gpus or [1]) * (args.ddp_steps + 2) if args.ddp_gpus else 0)
                    extract_random(model, target_dir, store, num_tokens=int(steps_needed * args.token_budget * args.rows * 1.1),
                                   max_length=args.max_length)
            else:
                raise SystemExit(f"unknown shape {shape!r} (reference, qwen3-8b)")
            row = {}
            for mode in args.modes:
                recipe = make_recipe(store, target_dir, workdir / f"out-{shape}-{mode}", args, verify_weights=False)
                row[mode] = throughput(recipe, args.steps, warmup=3, online_model=model if mode == "online" else None)
                print(f"{shape} {mode}: {row[mode]}", flush=True)
            results["throughput"][shape] = row
            del model
            if cuda:
                torch.cuda.empty_cache()
            if shape == "qwen3-8b" and args.ddp_gpus:
                results["ddp"] = {}
                for gpus in args.ddp_gpus:
                    results["ddp"][f"gpus_{gpus}"] = ddp_throughput(store, target_dir, workdir, args, gpus)
                    print(f"ddp {gpus}: {results['ddp'][f'gpus_{gpus}']}", flush=True)

        if args.skip_quality:
            raise _SkipQuality
        # bf16 vs fp8 after the same tokens, measured on held-out records.
        from pipelines.train.trainer import run_training

        ref_fp8 = workdir / "ref-fp8"
        held_out = workdir / "ref-eval"
        if not ref_fp8.exists():
            extract_reference(ref_fp8, TRAIN_DATA, args.records, args.max_length, "fp8_e4m3", extract_device)
        if not held_out.exists():
            extract_reference(held_out, TRAIN_DATA, max(8, args.records // 4), args.max_length, "bf16",
                              extract_device, skip=args.records)
        quality = {}
        for codec, store in (("bf16", ref_bf16), ("fp8_e4m3", ref_fp8)):
            out = workdir / f"quality-{codec}"
            shutil.rmtree(out, ignore_errors=True)
            summary = run_training(make_recipe(store, REFERENCE_TARGET, out, args, max_steps=args.quality_steps))
            quality[codec] = {"train_tokens": summary["tokens"], "held_out_acc": held_out_accuracy(
                Path(summary["checkpoint"]), held_out, args.token_budget, device)}
            print(f"quality {codec}: {quality[codec]}", flush=True)
        results["quality"] = quality
    except _SkipQuality:
        pass
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    print(format_table(results))
    if args.out:
        write_results(args.out, results)
    return 0


def format_table(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']}", "",
             "| shape | store tokens/s | online tokens/s | store / online | store data wait | MFU | peak GiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for shape, row in results["throughput"].items():
        s, o = row.get("store"), row.get("online")
        cells = [f"{s['tokens_per_s']:,.0f}" if s else "-", f"{o['tokens_per_s']:,.0f}" if o else "-",
                 f"{s['tokens_per_s'] / o['tokens_per_s']:.2f}x" if s and o else "-",
                 f"{100 * s['data_wait_frac']:.1f}%" if s else "-",
                 f"{100 * s['mfu']:.1f}%" if s and "mfu" in s else "-", f"{s['peak_gib']:.1f}" if s and "peak_gib" in s else "-"]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    if results.get("ddp"):
        lines += ["", "| torchrun GPUs | steady tokens/s (all GPUs) | per GPU | run tokens/s | data wait |", "|---:|---:|---:|---:|---:|"]
        for row in results["ddp"].values():
            if "error" in row:
                lines.append(f"| {row['gpus']} | error | | | |")
                continue
            lines.append(f"| {row['gpus']} | {row['tokens_per_s_steady']:,.0f} | {row['tokens_per_s_steady'] / row['gpus']:,.0f} | "
                         f"{row['tokens_per_s_run']:,.0f} | {100 * row['data_wait_frac']:.1f}% |")
    if "quality" in results:
        lines += ["", "| store codec | training tokens | held-out accuracy, depth 0..6 |", "|---|---:|---|"]
        for codec, row in results["quality"].items():
            lines.append(f"| {codec} | {row['train_tokens']:,} | {' '.join(f'{a:.3f}' for a in row['held_out_acc'])} |")
    return "\n".join(lines)


# Modes: ``python -m benchmarks.bench_train MODE --help``; without a mode, :func:`store_vs_online` runs.
MODES = {
    "ab": "benchmarks.train.ab",
    "profile": "benchmarks.train.profile_step",
    "eagle31": "benchmarks.train.eagle31",
    "step-modes": "benchmarks.train.step_modes",
}


def main(argv: list[str] | None = None) -> int:
    return run_modes(argv, store_vs_online, MODES, prog="python -m benchmarks.bench_train")


if __name__ == "__main__":
    raise SystemExit(main())
