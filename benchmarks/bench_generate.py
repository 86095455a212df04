"""Tokens generated per second: hsstore generate's decode loop against a plain ``model.generate`` loop.

The same prompts (random token ids of mixed lengths, length-sorted and cut into batches of
``--batch``), the same model, the same ``max_new_tokens`` and stop ids, both in the same process
one after the other (each after one warm-up batch). Greedy by default; ``--temperature T`` samples
on both paths (hsstore: its batched sampler with a seed per answer; plain: ``do_sample=True,
temperature=T, top_k=0, top_p=1.0``, the same distribution). hsstore's path is the transformers
backend's generator (pipelines/generate/engine.py: its own loop and KV cache, per-answer
seeds, finished answers dropped from the batch); the plain path is
``model.generate(input_ids, attention_mask, max_new_tokens=..., do_sample=...)`` per batch.
Tokens counted are new tokens before the stop token (padding after it excluded), per path.

    python -m benchmarks.bench_generate --quick                         # CPU smoke test (tiny model), seconds
    python -m benchmarks.bench_generate --shape qwen3-8b --device cuda  # H200: Qwen3-8B shape, random bf16 weights

writes ``benchmarks/results/generate-h200.json`` (``--out`` to change):
``{"hsstore_tokens_per_s", "plain_generate_tokens_per_s", "batch", ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO_ROOT
from pipelines.generate import engine  # noqa: E402
from pipelines.generate.engine import BatchGenerator, SamplingParams  # noqa: E402
from pipelines.generate.prompts import Request  # noqa: E402

QWEN3_8B = dict(  # Qwen/Qwen3-8B config.json (as benchmarks/bench_train.py)
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
)
EOS_ID = 2


def build_model(shape: str, device: torch.device) -> Any:
    """Random weights, built straight on the device in bf16 (CUDA) or float32 (CPU); ``reference``:
    the reference target's own weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if shape == "reference":
        from pipelines.extract.target import load_target

        dtype = "bfloat16" if device.type == "cuda" else "float32"
        return load_target(str(REPO_ROOT / "examples" / "reference-target"), dtype=dtype, device=str(device))

    config = Qwen3Config(**(QWEN3_8B if shape == "qwen3-8b" else TINY), architectures=["Qwen3ForCausalLM"],
                         eos_token_id=EOS_ID, pad_token_id=0)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.requires_grad_(False)
    return model


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=generator).tolist()
    # Ids from 3 up: never a stop or pad id in a prompt.
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def batches_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    ordered = sorted(prompts, key=len, reverse=True)
    return [ordered[i : i + batch] for i in range(0, len(ordered), batch)]


class _Tokenizer:
    """What BatchGenerator needs of a tokenizer to decode: the ids as text are not the point here."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hsstore(model: Any, batches: list[list[list[int]]], max_new: int, device: torch.device,
                temperature: float = 0.0) -> tuple[int, float]:
    generator = BatchGenerator(
        model, _Tokenizer(), stop_token_ids=[EOS_ID], pad_token_id=0, params=SamplingParams(temperature=temperature),
        max_batch_size=max(len(b) for b in batches), token_budget=1 << 40,
    )
    tokens = 0
    sync(device)
    start = time.perf_counter()
    seeds = iter(range(sum(len(b) for b in batches)))  # one per answer: sampled draws differ between answers
    for batch in batches:
        ids, _ = generator.generate_ids([Request(tuple(p), max_new, next(seeds)) for p in batch])
        tokens += sum(len(x) for x in ids)
    sync(device)
    return tokens, time.perf_counter() - start


@torch.inference_mode()
def run_plain(model: Any, batches: list[list[list[int]]], max_new: int, device: torch.device,
              temperature: float = 0.0) -> tuple[int, float]:
    # Sampling: temperature only (transformers' default top_k=50 switched off), as hsstore's path.
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {"do_sample": False}
    tokens = 0
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        width = max(len(p) for p in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
            eos_token_id=EOS_ID, pad_token_id=0, **sampling,
        )[:, width:]
        for row in out.tolist():
            tokens += next((i for i, t in enumerate(row) if t == EOS_ID), len(row))
    sync(device)
    return tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["qwen3-8b", "tiny", "reference"], default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled on both paths")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per path, alternating; best kept")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "generate-h200.json"))
    parser.add_argument(
        "--variants", default="engine", help="comma-separated settings of hsstore's path: engine (its defaults), "
        "no-cudnn (SDPA without cuDNN), preallocated / dynamic (the KV cache); the first is reported as "
        "hsstore_tokens_per_s, every one under 'variants'"
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU smoke: tiny shape, 16 prompts of 8-32 tokens, batch 8, 8 new tokens, 1 pass"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.shape, args.device, args.batch, args.num_prompts = "tiny", "cpu", 8, 16
        args.min_prompt, args.max_prompt, args.max_new_tokens, args.repeats = 8, 32, 8, 1

    device = torch.device(args.device)
    start = time.perf_counter()
    model = build_model(args.shape, device)
    build_seconds = time.perf_counter() - start
    prompts = make_prompts(args.num_prompts, args.min_prompt, args.max_prompt, model.config.vocab_size)
    batches = batches_of(prompts, args.batch)
    warm = [batches[0][: min(8, len(batches[0]))]]
    run_hsstore(model, warm, 8, device)
    run_plain(model, warm, 8, device)
    variants = args.variants.split(",")
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in variants}
    plain_runs = []
    defaults = engine.DECODE_SDPA, engine.KV_CACHE
    try:
        for _ in range(args.repeats):  # alternating, so drift (clocks, other load) hits every path
            for name in variants:
                engine.DECODE_SDPA, engine.KV_CACHE = defaults
                if name == "no-cudnn":
                    engine.DECODE_SDPA = name
                elif name in ("preallocated", "dynamic"):
                    engine.KV_CACHE = name
                elif name != "engine":
                    raise SystemExit(f"--variants: unknown variant {name!r}")
                runs[name].append(run_hsstore(model, batches, args.max_new_tokens, device, args.temperature))
            plain_runs.append(run_plain(model, batches, args.max_new_tokens, device, args.temperature))
    finally:
        engine.DECODE_SDPA, engine.KV_CACHE = defaults
    hsstore_runs = runs[variants[0]]
    best_h = max(t / s for t, s in hsstore_runs)
    best_p = max(t / s for t, s in plain_runs)
    result = {
        "hsstore_tokens_per_s": round(best_h, 1),
        "plain_generate_tokens_per_s": round(best_p, 1),
        "batch": args.batch,
        "temperature": args.temperature,
        "ratio": round(best_h / best_p, 3),
        "shape": args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts,
        "prompt_tokens": [args.min_prompt, args.max_prompt],
        "max_new_tokens": args.max_new_tokens,
        "hsstore_runs": [{"tokens": t, "seconds": round(s, 3)} for t, s in hsstore_runs],
        "plain_runs": [{"tokens": t, "seconds": round(s, 3)} for t, s in plain_runs],
        # Passes in the order run (per repeat: the variants, then plain); a first pass meets shapes
        # (batch, key length) no pass before it met, which costs kernels that plan per shape (cuDNN).
        "variants": {
            name: {
                "best_tokens_per_s": round(max(t / s for t, s in passes), 1),
                "runs": [{"tokens": t, "seconds": round(s, 3)} for t, s in passes],
            }
            for name, passes in runs.items()
        },
        "engine_defaults": {"sdpa": defaults[0] or "torch's choice", "kv_cache": defaults[1]},
        "model_build_seconds": round(build_seconds, 1),
        "torch": torch.__version__,
    }
    import transformers

    result["transformers"] = transformers.__version__
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
