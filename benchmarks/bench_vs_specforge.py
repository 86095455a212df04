"""hsstore's EAGLE-3 trainer side by side with SpecForge's, on the same features (issue 27).

One run trains the same draft twice per seed from the same features: once with ``hsstore train``
streaming the store, once with SpecForge 0.2.0's own offline trainer reading the same samples
written by ``hsstore export-features --format specforge`` (bit-exact). Both get hsstore's export
``config.json`` as the draft config, the same draft vocabulary (SpecForge is handed hsstore's
``d2t``/``t2d``), the same learning rate, warmup + cosine schedule, TTT length 7, tokens per step
and number of steps. Then both drafts are evaluated by ``hsstore evaluate`` (SpecForge's export
loads through ``load_draft``) on the same held-out prompts and a held-out store:

- per-depth held-out accuracy (the offline proxy on a store extracted from records neither
  trainer saw: a stable 10% of the records by a hash of their id),
- acceptance length: chain of 5 and tree 8/5/31 at temperature 0, tree at temperature 1,
- training tokens/s (real tokens, I/O included: SpecForge reads its files, hsstore its store).

Modes:

    python -m benchmarks.bench_vs_specforge reference --device cuda --steps 1000 --section reference_gpu
    python -m benchmarks.bench_vs_specforge reference --device cpu --steps 200 --max-length 512 \
        --token-budget 1024 --section reference_cpu
    python -m benchmarks.bench_vs_specforge qwen3-8b --device cuda --steps 30     # speed only

``--out`` (default benchmarks/results/vs-specforge.json) is updated in place: only ``--section``'s
key is replaced. SpecForge runs as a user would run it, in a subprocess; what it needs on a CPU
(an eager loss instead of its Triton kernel, no FSDP sharding) is a shim in
``benchmarks/specforge/peer.py``, stated there. It is installed with
``pip install --no-deps specforge==0.2.0`` (it pins torch and sglang, which its offline path does
not import); its other imports are listed in that module's docstring.
"""

from __future__ import annotations

import os

# Before torch loads (see pipelines/cli.py, OPENMP_DEFAULTS); SpecForge's subprocess inherits it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT
from benchmarks.evaluate.acceptance import acceptance_lengths

REFERENCE_TARGET = REPO_ROOT / "examples" / "reference-target"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "vs-specforge.json"
HELDOUT_FRACTION = 0.1
REFERENCE_AUX = [2, 4, 5]


# -- data and stores ---------------------------------------------------------------------------


def split_records(source: Path, workdir: Path, fraction: float = HELDOUT_FRACTION) -> tuple[Path, Path]:
    """Train and held-out JSONL files: a record is held out when sha256(id) falls in ``fraction``
    (stable, whatever the file order)."""
    train, heldout = workdir / "train.jsonl", workdir / "heldout.jsonl"
    with source.open() as src, train.open("w") as tr, heldout.open("w") as ho:
        for line in src:
            if not line.strip():
                continue
            record_id = str(json.loads(line).get("id"))
            digest = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
            (ho if digest < fraction * 2**64 else tr).write(line)
    return train, heldout


def extract(records: Path, store: Path, target: Path, device: str, max_length: int) -> str:
    """The project's extraction in process (no Ray needed on the GPU machine)."""
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    if (store / "manifest.json").exists():
        return str(store)
    recipe = build_recipe(
        ExtractRecipe,
        {
            "target": str(target),
            "data": [str(records)],
            "store": str(store),
            "executor": "local",
            "model": {"dtype": "bfloat16" if device.startswith("cuda") else "float32", "device": device},
            "capture": {"aux_layer_ids": REFERENCE_AUX},
            "batching": {"max_length": max_length, "too_long": "truncate", "token_budget": 16384},
            "units": {"max_tokens": 131072},
        },
    )
    run_extraction(recipe)
    return str(store)


# -- the two trainers --------------------------------------------------------------------------


LOADER_SHUFFLE_WINDOW = 1024  # hsstore's LoaderConfig default, which train_hsstore keeps


def hyperparameters(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """What both trainers are given; warmup is 5% of each run's own steps."""
    return {
        "steps": steps,
        "lr": args.lr,
        "warmup_steps": max(1, steps // 20),
        "min_lr_ratio": 0.0,  # SpecForge's cosine ends at 0 (not a knob there)
        "betas": (0.9, 0.999),  # SpecForge's AdamW is built with the default betas
        "weight_decay": 0.0,
        "grad_clip": 0.5,
        "ttt_length": 7,
        "token_budget": args.token_budget,
    }


def train_hsstore(store: str, target: Path, out: Path, seed: int, hp: dict[str, Any], device: str,
                  loss_normalization: str = "scored") -> dict[str, Any]:
    from pipelines.recipe import build_recipe
    from pipelines.train.config import TrainRecipe
    from pipelines.train.trainer import run_training

    recipe = build_recipe(
        TrainRecipe,
        {
            "store": store,
            "target": str(target),
            "output_dir": str(out),
            "max_steps": hp["steps"],
            "draft": {"vocab": {"draft_vocab_size": 2048}},
            "ttt_length": hp["ttt_length"],
            "optimizer": {"lr": hp["lr"], "betas": list(hp["betas"]), "weight_decay": hp["weight_decay"], "grad_clip": hp["grad_clip"]},
            "schedule": {"warmup_steps": hp["warmup_steps"], "min_lr_ratio": hp["min_lr_ratio"]},
            "loader": {"token_budget": hp["token_budget"], "rows_per_batch": 1, "long_samples": "truncate"},
            "loss_normalization": loss_normalization,
            "seed": seed,
            "device": device,
            "resume": False,
            "log_every": 50,
            "verify_weights": False,
        },
    )
    began = time.perf_counter()
    summary = run_training(recipe)
    summary["process_wall_s"] = time.perf_counter() - began
    return summary


def export_eagle3(run_dir: Path, out: Path) -> Path:
    from pipelines.export.serving import export_draft

    if (out / "config.json").exists():
        return out
    return export_draft(run_dir, "eagle3", out, dtype="bfloat16", include_embed_tokens=False)  # as served


# -- evaluation --------------------------------------------------------------------------------


def decode(draft: Path, prompts: Path, target: Path, device: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    return acceptance_lengths(
        draft, target=target, prompts=prompts, out=out, limit=args.prompts, max_new_tokens=args.max_new_tokens,
        device=device,
    )


# -- aggregation -------------------------------------------------------------------------------


def median_and_spread(values: list[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds, the spread [min, max] beside each, and every run kept."""
    out: dict[str, Any] = {}
    for key in ("al_chain5_t0", "al_tree_t0", "al_tree_t1", "tokens_per_s", "tokens_per_s_concurrent"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key], out[f"{key}_spread"] = median_and_spread(values)
    # No run alone on its device: no clean speed to report (the concurrent figure stays beside it).
    out.setdefault("tokens_per_s", None)
    depths = len(runs[0]["heldout_acc"])
    out["heldout_acc"] = [statistics.median(r["heldout_acc"][d] for r in runs) for d in range(depths)]
    out["heldout_acc_spread"] = [[min(r["heldout_acc"][d] for r in runs), max(r["heldout_acc"][d] for r in runs)] for d in range(depths)]
    out["runs"] = runs
    return out


def verdicts(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The issue's aims, judged from the medians and the seeds' spread."""
    ours_tree, theirs_tree = ours["al_tree_t0"], theirs["al_tree_t0"]
    spread = max(ours["al_tree_t0_spread"][1] - ours["al_tree_t0_spread"][0], theirs["al_tree_t0_spread"][1] - theirs["al_tree_t0_spread"][0])
    if ours_tree >= theirs_tree:
        tree = "met"
    elif theirs_tree - ours_tree <= spread:
        tree = "tie (within the seeds' spread)"
    else:
        tree = "not met"
    acc0 = ours["heldout_acc"][0] / theirs["heldout_acc"][0] - 1
    return {
        "al_tree_t0_ratio": ours_tree / theirs_tree,
        "al_tree_t0": tree,
        "heldout_acc0_rel_delta": acc0,
        "heldout_acc0": "met" if acc0 >= -0.01 else "not met",
    }


# -- modes -------------------------------------------------------------------------------------


def reference_paths(args: argparse.Namespace) -> dict[str, Path]:
    work = Path(args.workdir)
    return {
        "work": work,
        "train_store": work / "train-store",
        "heldout_store": work / "heldout-store",
        "features": work / "specforge-features",
        "plan": work / "plan.json",
    }


def default_data(args: argparse.Namespace) -> tuple[Path, Path]:
    shared_train, shared_eval = SHARED_DATA / "draft_train.jsonl", SHARED_DATA / "eval_prompts.jsonl"
    data = Path(args.data) if args.data else (shared_train if shared_train.exists() else REPO_ROOT / "examples" / "data" / "draft_train_slice.jsonl")
    prompts = Path(args.eval_prompts) if args.eval_prompts else (shared_eval if shared_eval.exists() else REPO_ROOT / "examples" / "data" / "eval_prompts.jsonl")
    return data, prompts


def stage_prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Split, extract both stores, write SpecForge's files, and fix the data order: both trainers
    visit the same samples in the same order for ``--epochs`` epochs (SpecForge one sample per
    step, hsstore packed rows of ``--token-budget`` tokens), so they see the same data; the steps
    differ by the packing."""
    import hsstore
    from benchmarks.specforge.peer import hsstore_sample_order
    from pipelines.export.features import export_features

    paths = reference_paths(args)
    paths["work"].mkdir(parents=True, exist_ok=True)
    data, prompts = default_data(args)
    train_jsonl, heldout_jsonl = split_records(data, paths["work"])
    t0 = time.perf_counter()
    train_store = extract(train_jsonl, paths["train_store"], Path(args.target), args.device, args.max_length)
    extract(heldout_jsonl, paths["heldout_store"], Path(args.target), args.device, args.max_length)
    if not (paths["features"] / "hsstore-export.json").exists():
        export_features(train_store, paths["features"], "specforge", overwrite=True, progress=False)
    store = hsstore.open_store(train_store)
    orders, steps = {}, {}
    for seed in args.seeds:
        order = hsstore_sample_order(store, seed=seed, token_budget=args.token_budget, rows_per_batch=1,
                                     shuffle_window=LOADER_SHUFFLE_WINDOW, epochs=args.epochs)
        orders[str(seed)] = order
        steps[str(seed)] = sum(len(store_plan_rows(store, args, seed, e)) for e in range(args.epochs))
    plan = {
        "epochs": args.epochs, "token_budget": args.token_budget, "max_length": args.max_length,
        "train_records": sum(1 for _ in train_jsonl.open()), "heldout_records": sum(1 for _ in heldout_jsonl.open()),
        "train_samples": store.num_samples, "train_tokens": store.num_tokens,
        "hsstore_steps": steps, "specforge_steps": {k: len(v) for k, v in orders.items()},
        "orders": orders, "prompts": str(prompts), "prepare_seconds": time.perf_counter() - t0, "machine": machine(),
    }
    paths["plan"].write_text(json.dumps(plan))
    return plan


def store_plan_rows(store: Any, args: argparse.Namespace, seed: int, epoch: int) -> list[Any]:
    from hsstore.loader import StreamingLoader

    loader = StreamingLoader(store, [], token_budget=args.token_budget, rows_per_batch=1, seed=seed,
                             shuffle_window=LOADER_SHUFFLE_WINDOW, remainder="drop", long_samples="truncate")
    return loader.plan(epoch).batches


def stage_train(args: argparse.Namespace, trainer: str) -> None:
    from benchmarks.specforge.peer import train_specforge

    paths = reference_paths(args)
    plan = json.loads(paths["plan"].read_text())
    target = Path(args.target)
    if trainer == "hsstore" and args.loss_normalization != "scored":
        trainer = f"hsstore_{args.loss_normalization}"  # a variant, reported beside the default
    if trainer == "hsstore" and args.equal_steps:
        trainer = "hsstore_equal_steps"  # SpecForge's step count: the packed rows run past the epochs
    for seed in args.seeds:
        out = paths["work"] / f"{trainer}-seed{seed}"
        steps_key = "specforge_steps" if trainer in ("specforge", "hsstore_equal_steps") else "hsstore_steps"
        hp = hyperparameters(args, plan[steps_key][str(seed)])
        if trainer.startswith("hsstore"):
            summary = train_hsstore(str(paths["train_store"]), target, out, seed, hp, args.device, args.loss_normalization)
            export = export_eagle3(out, paths["work"] / f"{trainer}-seed{seed}-export")
            result = {"tokens_per_s": summary["tokens_per_s"], "train_seconds": summary["wall_s"],
                      "final_loss": summary["final_loss"], "steps": hp["steps"], "export_dir": str(export)}
        else:
            vocab = vocab_export(paths["work"])
            sf = train_specforge(
                paths["features"], vocab / "config.json", vocab, target, out,
                steps=hp["steps"], lr=hp["lr"], warmup_steps=hp["warmup_steps"], min_lr_ratio=hp["min_lr_ratio"],
                ttt_length=hp["ttt_length"], max_len=args.max_length, batch_size=1, seed=seed,
                device=args.device, grad_clip=hp["grad_clip"], betas=hp["betas"], weight_decay=hp["weight_decay"],
                sample_order=plan["orders"][str(seed)], log_interval=log_interval(hp["steps"]),
            )
            result = {k: sf[k] for k in ("tokens_per_s", "train_seconds", "final_loss", "steps", "export_dir", "shims") if k in sf}
        result.update(seed=seed, trainer=trainer, concurrent=args.concurrent)
        (paths["work"] / f"train-{trainer}-{seed}.json").write_text(json.dumps(result))
        print(json.dumps(result), flush=True)


def vocab_export(work: Path) -> Path:
    """hsstore's export whose ``config.json`` and ``d2t``/``t2d`` SpecForge is handed. The draft
    vocabulary is counted from the store, so every hsstore run on it exports the same map; the
    first one found is used (``--stage vocab`` makes one without a full run, so that SpecForge
    need not wait for hsstore's training)."""
    for name in ("vocab-export", "hsstore-seed0-export", "hsstore_equal_steps-seed0-export"):
        if (work / name / "config.json").exists():
            return work / name
    raise FileNotFoundError(f"{work}: no hsstore export to take the draft vocabulary from; run --stage vocab first")


def stage_vocab(args: argparse.Namespace) -> Path:
    """One hsstore step on the training store, exported: the draft config and vocabulary for
    SpecForge (its weights are not used)."""
    paths = reference_paths(args)
    out = paths["work"] / "vocab-run"
    hp = hyperparameters(args, 1)
    train_hsstore(str(paths["train_store"]), Path(args.target), out, 0, hp, args.device)
    return export_eagle3(out, paths["work"] / "vocab-export")


def log_interval(steps: int) -> int:
    """The largest of 50, 25, 10, 5, 1 that divides ``steps`` (SpecForge's runner needs one)."""
    return next(n for n in (50, 25, 10, 5, 1) if steps % n == 0)


def stage_heldout(args: argparse.Namespace) -> None:
    """Per-depth accuracy of every trained draft on the held-out store (hsstore's offline proxy,
    the same code for both drafts)."""
    from benchmarks.evaluate.acceptance import heldout_accuracy

    paths = reference_paths(args)
    for result_file in sorted(paths["work"].glob("train-*-*.json")):
        result = json.loads(result_file.read_text())
        if "heldout_acc" in result and not args.redo:
            continue
        result["heldout_acc"] = heldout_accuracy(
            Path(result["export_dir"]), store=paths["heldout_store"], target=Path(args.target),
            device=args.eval_device, max_samples=args.heldout_samples,
        )
        result_file.write_text(json.dumps(result))
        print(result["trainer"], result["seed"], [round(a, 4) for a in result["heldout_acc"]], flush=True)


def stage_decode(args: argparse.Namespace) -> None:
    """Acceptance length of every trained draft (chain 5 and tree 8/5/31 at T=0, tree at T=1)."""
    paths = reference_paths(args)
    _, prompts = default_data(args)
    for result_file in sorted(paths["work"].glob("train-*-*.json")):
        result = json.loads(result_file.read_text())
        if result["seed"] not in args.seeds:  # --seeds splits the drafts between processes
            continue
        if args.draft_root:  # drafts brought back from another machine
            result["export_dir"] = str(Path(args.draft_root) / Path(result["export_dir"]).name)
        if "al_tree_t0" in result and not args.redo:
            continue
        scores = decode(Path(result["export_dir"]), prompts, Path(args.target), args.eval_device, args,
                        paths["work"] / f"eval-{result['trainer']}-{result['seed']}")
        result.update(scores, decode_prompts=args.prompts, decode_max_new_tokens=args.max_new_tokens)
        result_file.write_text(json.dumps(result))
        print(result["trainer"], result["seed"], scores, flush=True)


def stage_report(args: argparse.Namespace) -> dict[str, Any]:
    paths = reference_paths(args)
    plan = json.loads(paths["plan"].read_text())
    runs: dict[str, list[dict[str, Any]]] = {"hsstore": [], "specforge": []}
    for result_file in sorted(paths["work"].glob("train-*-*.json")):
        result = json.loads(result_file.read_text())
        if result.get("concurrent"):
            # trained beside other runs on the same device: its speed is not a clean figure
            result["tokens_per_s_concurrent"] = result.pop("tokens_per_s")
        runs.setdefault(result["trainer"], []).append(result)
    steps = {"hsstore": plan["hsstore_steps"], "specforge": plan["specforge_steps"]}
    compared_at = "equal data (the same samples for the same epochs; hsstore's packed rows take fewer steps)"
    if runs.get("hsstore_equal_steps"):
        # The issue judges the drafts at equal steps: those runs are "hsstore"; the equal-data runs
        # stay beside them as a variant, with their own verdicts.
        runs["hsstore_equal_data"] = runs.pop("hsstore", [])
        runs["hsstore"] = runs.pop("hsstore_equal_steps")
        steps = {"hsstore": plan["specforge_steps"], "specforge": plan["specforge_steps"], "hsstore_equal_data": plan["hsstore_steps"]}
        compared_at = ("equal steps (SpecForge's count; hsstore's packed rows hold more tokens, so it sees "
                       "more data), the equal-data runs under hsstore_equal_data")
    runs = {name: found for name, found in runs.items() if found}
    ours, theirs = aggregate(runs["hsstore"]), aggregate(runs["specforge"])
    variants = {name: aggregate(found) for name, found in runs.items() if name not in ("hsstore", "specforge")}
    return {
        **{name: summary for name, summary in variants.items()},
        **{f"verdicts_{name}": verdicts(summary, theirs) for name, summary in variants.items()},
        "steps": steps,
        "compared_at": compared_at,
        "epochs": plan["epochs"],
        "seeds": len(runs["hsstore"]),
        "hyperparameters": {
            **{k: list(v) if isinstance(v, tuple) else v for k, v in hyperparameters(args, 0).items() if k not in ("steps", "warmup_steps")},
            "warmup": "linear over 5% of each run's steps, then cosine to 0",
        },
        "trained_on": plan.get("machine") or args.trained_on,
        "decoded_on": machine(),
        **{k: plan[k] for k in ("train_records", "heldout_records", "train_samples", "train_tokens", "max_length", "token_budget")},
        "eval_prompts": next((r["decode_prompts"] for r in runs["hsstore"] if "decode_prompts" in r), args.prompts),
        "max_new_tokens": next((r["decode_max_new_tokens"] for r in runs["hsstore"] if "decode_max_new_tokens" in r), args.max_new_tokens),
        "hsstore": ours,
        "specforge": theirs,
        "verdicts": verdicts(ours, theirs),
    }


# -- Qwen3-8B shape: speed only ----------------------------------------------------------------

QWEN3_8B = dict(  # Qwen/Qwen3-8B config.json
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
)
# The same code path at a size a CPU runs in seconds (the smoke test's); the draft vocabulary
# keeps the 8B run's quarter-ish share of the target's.
TINY_SHAPE = dict(QWEN3_8B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SHAPES = {"qwen3-8b": (QWEN3_8B, 32000), "tiny": (TINY_SHAPE, 1024)}


def random_heads_target(workdir: Path, shape: dict[str, Any]) -> Path:
    """A Qwen3-8B-shaped target directory holding only what both trainers read of it: its config,
    and random bf16 embed_tokens, final norm and lm_head (the transformer stack is never loaded)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    target = workdir / f"heads-{shape['hidden_size']}"
    if (target / "model.safetensors").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    Qwen3Config(**shape, architectures=["Qwen3ForCausalLM"]).save_pretrained(target)
    gen = torch.Generator().manual_seed(0)
    matrix = (shape["vocab_size"], shape["hidden_size"])
    tensors = {
        "model.embed_tokens.weight": (torch.randn(matrix, generator=gen) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(shape["hidden_size"], dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(matrix, generator=gen) * 0.02).to(torch.bfloat16),
    }
    save_file(tensors, str(target / "model.safetensors"))
    # SpecForge's target head finds its tensors through the index that sharded checkpoints carry.
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in tensors}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def random_store(store: Path, target: Path, shape: dict[str, Any], num_samples: int, length: int) -> str:
    """Random bf16 features of the 8B shape, every position in the loss mask: the same bytes go to
    both trainers (hsstore streams the store, SpecForge reads the exported files)."""
    import numpy as np
    import torch

    import hsstore
    from pipelines import target_identity as ti

    if (store / "manifest.json").exists():
        return str(store)
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    aux = [2, layers // 2, layers - 3]
    lineage = hsstore.Lineage(target=ti.identity_model(target), aux_layer_ids=aux, max_length=length)
    specs = [hsstore.FeatureSpec(name="aux_hidden_states", shape=(len(aux), hidden)),
             hsstore.FeatureSpec(name="final_hidden_state", shape=(hidden,))]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    with hsstore.StoreWriter(str(store), specs, lineage, shard_max_tokens=1 << 16) as writer:
        for i in range(num_samples):
            ids = torch.randint(0, shape["vocab_size"], (length,), generator=gen, device=device)
            features = {
                "aux_hidden_states": torch.randn(length, len(aux), hidden, generator=gen, device=device).to(torch.bfloat16).cpu(),
                "final_hidden_state": torch.randn(length, hidden, generator=gen, device=device).to(torch.bfloat16).cpu(),
            }
            writer.add_sample(sample_id=f"rand-{i}", source_id=f"rand-{i}", input_ids=ids.cpu().numpy(),
                              loss_mask=np.ones(length, dtype=np.uint8), features=features)
    return str(store)


def steady_tokens_per_s(metrics: Path, skip_steps: int) -> float:
    """tokens/s over the log intervals that start after ``skip_steps`` (compilation and the first
    reads left out, as for SpecForge's figure)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "tokens" in r and "wall_s" in r]
    kept, previous = [], 0
    for row in rows:
        if previous >= skip_steps:
            kept.append(row)
        previous = row["step"]
    return sum(r["tokens"] for r in kept) / sum(r["wall_s"] for r in kept)


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.specforge.peer import train_specforge
    from pipelines.export.features import export_features

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    length = args.token_budget
    num_samples = args.steps + 2
    t0 = time.perf_counter()
    shape, draft_vocab = SHAPES[args.shape]
    target = random_heads_target(work, shape)
    store = random_store(work / "store-8b", target, shape, num_samples, length)
    features = work / "specforge-features-8b"
    if not (features / "hsstore-export.json").exists():
        export_features(store, features, "specforge", overwrite=True)
    print(f"target, store and SpecForge files ready in {time.perf_counter() - t0:.0f} s", flush=True)
    hp = hyperparameters(args, args.steps)
    hp["lr"] = 1e-4
    warm = max(5, args.steps // 4) if args.steps >= 20 else 1  # a smoke run keeps all but step 1
    ours = train_hsstore_8b(store, target, work / "hsstore-8b", hp, args, draft_vocab)
    ours_tps = steady_tokens_per_s(work / "hsstore-8b" / "metrics.jsonl", warm)
    export = export_eagle3(work / "hsstore-8b", work / "hsstore-8b-export")
    theirs = train_specforge(
        features, export / "config.json", export, target, work / "specforge-8b",
        steps=hp["steps"], lr=hp["lr"], warmup_steps=hp["warmup_steps"], min_lr_ratio=0.0,
        ttt_length=7, max_len=length, batch_size=1, seed=0, device=args.device,
        grad_clip=hp["grad_clip"], betas=(0.9, 0.999), weight_decay=0.0, log_interval=5 if hp["steps"] % 5 == 0 else 1,
    )
    if theirs.get("steady_tokens_per_s") is None:  # a single logged window: nothing to leave out
        theirs["steady_tokens_per_s"] = theirs["tokens_per_s"]
    return {
        "hsstore_tokens_per_s": ours_tps,
        "specforge_tokens_per_s": theirs["steady_tokens_per_s"],
        "ratio": ours_tps / theirs["steady_tokens_per_s"],
        "aim_1_2x": "met" if ours_tps >= 1.2 * theirs["steady_tokens_per_s"] else "not met",
        "steps": hp["steps"],
        "steady_state_from_step": warm,
        "row_tokens": length,
        "hsstore_whole_run_tokens_per_s": ours["tokens_per_s"],
        "specforge_whole_run_tokens_per_s": theirs["tokens_per_s"],
        "specforge_shims": theirs.get("shims"),
    }


def train_hsstore_8b(store: str, target: Path, out: Path, hp: dict[str, Any], args: argparse.Namespace, draft_vocab: int) -> dict[str, Any]:
    from pipelines.recipe import build_recipe
    from pipelines.train.config import TrainRecipe
    from pipelines.train.trainer import run_training

    recipe = build_recipe(
        TrainRecipe,
        {
            "store": store, "target": str(target), "output_dir": str(out), "max_steps": hp["steps"],
            "draft": {"vocab": {"draft_vocab_size": draft_vocab}}, "ttt_length": 7,
            "optimizer": {"lr": hp["lr"], "betas": [0.9, 0.999], "weight_decay": 0.0, "grad_clip": hp["grad_clip"]},
            "schedule": {"warmup_steps": hp["warmup_steps"], "min_lr_ratio": 0.0},
            "loader": {"token_budget": args.token_budget, "rows_per_batch": 1},
            "seed": 0, "device": args.device, "resume": False, "log_every": 1, "verify_weights": False,
        },
    )
    return run_training(recipe)


def machine() -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_section(out: Path, section: str, result: dict[str, Any]) -> None:
    data = json.loads(out.read_text()) if out.exists() else {}
    result["machine"] = machine()
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    data[section] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("reference", "qwen3-8b"))
    parser.add_argument("--stage", default="all", choices=STAGES,
                        help="reference mode: one stage (each reads what the previous wrote in --workdir)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eval-device", default=None, help="where drafts are evaluated (default: --device)")
    parser.add_argument("--epochs", type=int, default=2, help="reference: passes over the training store")
    parser.add_argument("--steps", type=int, default=40, help="qwen3-8b: optimizer steps of each trainer")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-8b", help="qwen3-8b mode: tiny for a CPU smoke run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--token-budget", type=int, default=2048, help="hsstore's tokens per packed row (8B: per sample)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=50, help="held-out prompts decoded per draft")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--heldout-samples", type=int, default=64)
    parser.add_argument("--loss-normalization", choices=("scored", "tokens"), default="scored",
                        help="train-hsstore: the trainer's loss_normalization (tokens: reported as hsstore_tokens)")
    parser.add_argument("--equal-steps", action="store_true",
                        help="train-hsstore: as many steps as SpecForge takes (reported as hsstore_equal_steps)")
    parser.add_argument("--concurrent", action="store_true", help="this training runs beside others (its tokens/s is not reported)")
    parser.add_argument("--trained-on", default=None, help="report: the training machine, for plans that did not record it")
    parser.add_argument("--draft-root", default=None, help="decode: the exported drafts' folder, if moved")
    parser.add_argument("--redo", action="store_true", help="decode: again even where done")
    parser.add_argument("--data", default=None)
    parser.add_argument("--eval-prompts", default=None)
    parser.add_argument("--target", default=str(REFERENCE_TARGET))
    parser.add_argument("--workdir", default="/tmp/bench-vs-specforge")
    parser.add_argument("--section", default=None, help="key of the results file to write (default by mode and device)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    args.eval_device = args.eval_device or args.device
    return args


STAGES = ("all", "prepare", "vocab", "train-hsstore", "train-specforge", "heldout", "decode", "report")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "qwen3-8b":
        result = run_speed(args)
        write_section(Path(args.out), args.section or "qwen3_8b_shape_gpu", result)
        print(json.dumps(result, indent=1))
        return 0
    stages = STAGES[1:] if args.stage == "all" else (args.stage,)
    for stage in stages:
        print(f"== {stage}", flush=True)
        if stage == "prepare":
            plan = stage_prepare(args)
            print(json.dumps({k: v for k, v in plan.items() if k != "orders"}), flush=True)
        elif stage == "vocab":
            print(stage_vocab(args), flush=True)
        elif stage.startswith("train-"):
            stage_train(args, stage.removeprefix("train-"))
        elif stage == "heldout":
            stage_heldout(args)
        elif stage == "decode":
            stage_decode(args)
        else:
            result = stage_report(args)
            write_section(Path(args.out), args.section or ("reference_gpu" if args.device.startswith("cuda") else "reference_cpu"), result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("hsstore", "specforge")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
