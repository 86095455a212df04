"""Train an EAGLE-3 draft with SpecForge 0.2.0's own offline trainer, for side-by-side benchmarks.

``train_specforge`` runs ``specforge train`` (sgl-project's trainer, its offline EAGLE-3 path, as
a user runs it: a YAML config, one process) in a **subprocess** on a directory of features in
SpecForge's offline layout (``rows_<g>-<g+5000>/data_<i>.ckpt``: ``input_ids``/``loss_mask`` [T]
int64, ``hidden_state`` [1, T, H] after the target's final norm, ``aux_hidden_state`` [1, T, 3H]),
then ``specforge export --to hf``, whose directory loads through hsstore's
``pipelines.models.checkpoint.load_draft``. It returns the training tokens/s (real tokens, padding
excluded, over SpecForge's own per-step wall time: data reads included) and the export's path.

Requirements: ``pip install --no-deps specforge==0.2.0`` (it pins torch 2.11, transformers 5.8.1
and sglang 0.5.14; the offline path imports none of sglang, and runs on torch 2.11-2.13 and
transformers 5.x here) plus ``accelerate`` (its ``set_seed``), ``pydantic``, ``pyyaml``,
``safetensors``, ``huggingface_hub``, ``numpy``, ``tqdm`` and, on CUDA, ``triton`` (its KL kernel).
``benchmarks/specforge_gpu_wheels.sh`` fetches what the GPU image lacks.

What is mapped, and how (hsstore recipe key -> SpecForge config key):

- ``optimizer.lr`` -> ``training.learning_rate``; ``optimizer.grad_clip`` ->
  ``training.max_grad_norm`` (both clip the global L2 norm).
- ``schedule.warmup_steps`` -> ``training.warmup_ratio`` (SpecForge warms up for
  ``int(ratio * total_steps)`` steps; the ratio is chosen so that this is exactly the steps given).
  Both warm up linearly, then cosine-decay. SpecForge's cosine ends at 0 (``eta_min`` is not a
  knob) where hsstore's ends at ``min_lr_ratio * lr``.
- ``optimizer.betas``/``weight_decay``: not knobs in SpecForge (``BF16Optimizer`` builds
  ``AdamW(lr, weight_decay=0)``: betas (0.9, 0.999)). Values other than those, or a
  ``min_lr_ratio`` other than 0, are refused unless ``patch_optimizer=True``, which patches
  ``BF16Optimizer`` in the subprocess to hsstore's betas, weight decay and final LR (a shim: say so
  in results). Matching hsstore's recipe to SpecForge's fixed values needs no shim.
- ``ttt_length`` -> ``training.ttt_length``; ``max_steps`` -> ``training.max_steps`` (the schedule's
  length too); ``seed`` -> ``training.seed`` (draft init and SpecForge's sampler).
- Batch shape: SpecForge has no packing: ``training.batch_size`` samples per micro-batch, each
  truncated to ``data.max_length`` and padded to the longest in the batch;
  ``accumulation_steps`` micro-batches per optimizer step.
- Data order: SpecForge's offline sampler always shuffles (``torch.randperm`` seeded with
  ``seed + epoch`` over the sorted file list). Given ``sample_order`` (sample ids, the ``i`` of
  ``data_<i>.ckpt``; e.g. :func:`hsstore_sample_order`), a directory of symlinks is laid out whose
  sorted names, permuted by exactly that ``randperm``, yield ``sample_order`` in one epoch: the
  order is matched without touching SpecForge's code.
- Draft config and vocabulary: hsstore's export ``config.json`` is SpecForge's
  ``model.draft_model_config`` (and ``--draft-config`` of the export); the ``d2t``/``t2d`` of
  hsstore's export are written as SpecForge's ``model.vocab_mapping_path``, so it does not count
  its own. Warm start: none; SpecForge copies the target's embedding and freezes it, like hsstore.

Shims (only where SpecForge cannot run otherwise; reported in the result's ``shims``):

- CPU only, ``cpu-loss``: ``specforge.core.loss`` (a Triton kernel; imports ``triton``) is
  replaced before import by an eager torch function with the same value and gradient: per
  position ``-sum_v p_target * log_softmax(logits)``, zero where ``position_mask`` is 0, averaged
  over all B*T positions.
- CPU only, config: ``training.fsdp_sharding=NO_SHARD`` (FSDP refuses the CPU) and
  ``training.attention_backend=sdpa`` (its default ``flex_attention`` is CUDA-only here).
- ``optimizer`` (opt-in, ``patch_optimizer=True``): see above.
- ``aligned-loss-mask`` (opt-in data shim, ``align_loss_mask=True``): SpecForge trains on copies
  whose loss mask is shifted left by two, so that it scores the positions hsstore scores
  (docs/vs-specforge.md, item 1).

The code shims live in ``benchmarks/specforge_shims.py``, the script the subprocess runs when a
shim is needed (it applies them, then calls ``specforge.cli.main``).

On CUDA with SpecForge-compatible optimizer knobs nothing is patched: ``python -m specforge.cli``.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECFORGE_BETAS = (0.9, 0.999)  # torch.optim.AdamW's default, used by specforge.optimizer
SPECFORGE_WEIGHT_DECAY = 0.0
RUN_ID = "specforge-run"
ALIGNED_LOSS_MASK_SHIM = "aligned-loss-mask: loss_mask shifted left by two in a copy of the features"
SHIMS_SCRIPT = Path(__file__).resolve().with_name("specforge_shims.py")  # runs in the subprocess
_FEATURE_NAME = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
_STEP_LINE = re.compile(r"^step (\d+): (\{.*\})\s*$")


class SpecForgeRunError(RuntimeError):
    """SpecForge's trainer or exporter failed, or its inputs are not what it needs."""


def feature_files(features_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """``{i: path}`` for every ``data_<i>.ckpt`` under ``features_dir`` (SpecForge's layout)."""
    found: dict[int, Path] = {}
    for path in sorted(Path(features_dir).rglob("data_*.ckpt*")):
        match = _FEATURE_NAME.match(path.name)
        if match is None:
            continue
        sample = int(match.group(1))
        if sample in found:
            raise SpecForgeRunError(f"{features_dir}: sample {sample} twice ({found[sample]}, {path})")
        found[sample] = path
    if not found:
        raise SpecForgeRunError(f"{features_dir}: no rows_*/data_<i>.ckpt files (SpecForge's offline layout)")
    return found


def sample_lengths(files: dict[int, Path]) -> dict[int, int]:
    """Tokens per sample, from ``input_ids`` alone (``torch.load`` with ``mmap``: no feature bytes read)."""
    import torch

    return {i: int(torch.load(p, mmap=True, weights_only=True)["input_ids"].numel()) for i, p in files.items()}


def write_vocab_mapping(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write SpecForge's ``{"d2t", "t2d"}`` mapping file from hsstore's draft vocabulary.

    ``source``: an exported draft directory or its ``model.safetensors`` (``d2t`` [draft] int64
    offsets, ``t2d`` [target] bool: the convention SpecForge uses too), or an existing ``.pt``.
    """
    import torch
    from safetensors.torch import load_file

    source = Path(source)
    weights = source / "model.safetensors" if source.is_dir() else source
    tensors = torch.load(weights, weights_only=True) if weights.suffix == ".pt" else load_file(weights)
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise SpecForgeRunError(f"{weights}: no {missing}; export the hsstore draft with `hsstore export`")
    d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    target_ids = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all()):
        raise SpecForgeRunError(f"{weights}: t2d marks {int(t2d.sum())} ids, not the {d2t.numel()} of d2t")
    # SpecForge's teacher is softmax(logits[..., t2d]): target-id order must be draft-id order.
    if not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise SpecForgeRunError(f"{weights}: draft ids are not sorted by target id, as SpecForge's teacher assumes")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": d2t, "t2d": t2d}, path)
    return path


def specforge_epoch_order(num_files: int, seed: int, epoch: int) -> list[int]:
    """Positions in the sorted file list, in the order SpecForge's offline sampler visits them."""
    from specforge.launch import _distributed_sampler_indices

    return list(_distributed_sampler_indices(num_files, dp_rank=0, dp_size=1, seed=seed, epoch=epoch))


def ordered_view(files: dict[int, Path], sample_order: Sequence[int], seed: int, view_dir: Path) -> Path:
    """Symlinks under ``view_dir`` that SpecForge's epoch 0 (with ``seed``) visits in ``sample_order``."""
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    unknown = sorted(set(sample_order) - set(files))
    if unknown:
        raise SpecForgeRunError(f"sample_order names samples with no data_<i>.ckpt file: {unknown[:10]}")
    names = [view_dir / f"rows_{p // 5000 * 5000}-{p // 5000 * 5000 + 5000}" / f"data_{p}.ckpt"
             for p in range(len(sample_order))]
    names.sort(key=lambda p: str(p.absolute()))  # SpecForge sorts absolute paths as strings
    for position, sample in zip(specforge_epoch_order(len(names), seed, 0), sample_order, strict=True):
        link = names[position]
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(files[sample].resolve())
    if list_feature_files(str(view_dir)) != [str(p.absolute()) for p in names]:
        raise SpecForgeRunError(f"{view_dir}: SpecForge lists the view's files in another order")
    return view_dir


def aligned_loss_mask_copy(files: dict[int, Path], samples: Sequence[int], out_dir: Path) -> dict[int, Path]:
    """Copies of ``samples`` whose ``loss_mask`` is shifted left by two (0 for the last two tokens).

    SpecForge scores the prediction of token ``j + 2`` with ``loss_mask[j]`` (docs/vs-specforge.md,
    item 1); with ``loss_mask'[j] = loss_mask[j + 2]`` it scores exactly the positions hsstore
    scores. A data shim, for comparing the trainers rather than that convention.
    """
    import torch

    copies: dict[int, Path] = {}
    for sample in sorted(set(samples)):
        data = torch.load(files[sample], weights_only=True)
        mask = torch.zeros_like(data["loss_mask"])
        mask[:-2] = data["loss_mask"][2:]
        data["loss_mask"] = mask
        path = out_dir / f"rows_{sample // 5000 * 5000}-{sample // 5000 * 5000 + 5000}" / f"data_{sample}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, path)
        copies[sample] = path
    return copies


def hsstore_sample_order(store: Any, *, seed: int, token_budget: int, rows_per_batch: int,
                         shuffle_window: int, epochs: int, remainder: str = "drop") -> list[int]:
    """The samples ``hsstore train`` visits (rows flattened, epoch after epoch), for ``sample_order``."""
    from hsstore.loader import StreamingLoader

    loader = StreamingLoader(store, [], token_budget=token_budget, rows_per_batch=rows_per_batch, seed=seed,
                             shuffle_window=shuffle_window, remainder=remainder, long_samples="truncate")
    return [int(s) for e in range(epochs) for batch in loader.plan(e).batches for row in batch for s in row]


def write_features_from_store(store: Any, out_dir: str | os.PathLike[str], limit: int | None = None) -> Path:
    """SpecForge's offline files from an hsstore store, sample ``i`` as ``data_<i>.ckpt``.

    A stand-in for ``hsstore export-features --format specforge`` in tests: the aux states
    ``[T, A, H]`` become ``[1, T, A*H]`` (layers concatenated in the store's order), the post-norm
    final state ``[1, T, H]``, the loss mask int64; the bits are the store's.
    """
    import torch

    import hsstore

    store = hsstore.open_store(store) if isinstance(store, (str, os.PathLike)) else store
    out = Path(out_dir)
    for i in range(store.num_samples if limit is None else min(limit, store.num_samples)):
        sample = store.read_sample(i)
        aux = sample["aux_hidden_states"]
        rows = out / f"rows_{i // 5000 * 5000}-{i // 5000 * 5000 + 5000}"
        rows.mkdir(parents=True, exist_ok=True)
        torch.save({
            "input_ids": sample["input_ids"].to(torch.int64),
            "loss_mask": sample["loss_mask"].to(torch.int64),
            "hidden_state": sample["final_hidden_state"].unsqueeze(0).contiguous(),
            "aux_hidden_state": aux.reshape(1, aux.shape[0], -1).contiguous(),
        }, rows / f"data_{i}.ckpt")
    return out


def specforge_config(*, features_dir: Path, draft_config: Path, vocab_mapping: Path, target_dir: Path,
                     out_dir: Path, steps: int, num_epochs: int, lr: float, warmup_steps: int,
                     ttt_length: int, max_len: int, batch_size: int, accumulation_steps: int, seed: int,
                     grad_clip: float, cpu: bool, attention_backend: str | None,
                     log_interval: int, dataloader_num_workers: int | None) -> dict[str, Any]:
    """The ``specforge train`` config (its pydantic ``Config``, as YAML) for these knobs."""
    if not 0 <= warmup_steps < steps:
        raise SpecForgeRunError(f"warmup_steps={warmup_steps} must be in [0, steps={steps})")
    # SpecForge warms up for int(ratio * total_steps) steps: aim at the middle of the integer.
    warmup_ratio = min(1.0, (warmup_steps + 0.5) / steps) if warmup_steps else 0.0
    assert int(warmup_ratio * steps) == warmup_steps
    training: dict[str, Any] = {
        "strategy": "eagle3", "max_steps": steps, "total_steps": steps, "num_epochs": num_epochs,
        "batch_size": batch_size, "accumulation_steps": accumulation_steps,
        "learning_rate": lr, "lr_scheduler": "cosine", "warmup_ratio": warmup_ratio,
        "max_grad_norm": grad_clip, "ttt_length": ttt_length, "seed": seed,
        "log_interval": log_interval, "save_interval": 0,
    }
    if cpu:
        training["fsdp_sharding"] = "NO_SHARD"
    backend = attention_backend or ("sdpa" if cpu else None)
    if backend is not None:
        training["attention_backend"] = backend
    data: dict[str, Any] = {"hidden_states_path": str(features_dir), "max_length": max_len,
                            "cache_dir": str(out_dir / "cache")}
    if dataloader_num_workers is not None:
        data["dataloader_num_workers"] = dataloader_num_workers
    return {
        "model": {"target_model_path": str(target_dir), "draft_model_config": str(draft_config),
                  "vocab_mapping_path": str(vocab_mapping), "torch_dtype": "bfloat16",
                  "load_target_embedding": True},
        "data": data,
        "training": training,
        "run_id": RUN_ID,
        "output_dir": str(out_dir / "train"),
    }


def _run(cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> float:
    """Run ``cmd`` with its output in ``log_path``; its wall seconds. Raises with the log's tail."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SpecForgeRunError(f"{' '.join(cmd)} exited with {returncode}; see {log_path}:\n{tail}")
    return time.perf_counter() - started


def parse_step_metrics(log_text: str) -> list[tuple[int, dict[str, Any]]]:
    """SpecForge's ``step N: {...}`` lines (its console logger), in order."""
    steps = []
    for line in log_text.splitlines():
        match = _STEP_LINE.match(line.strip())
        if match:
            steps.append((int(match.group(1)), ast.literal_eval(match.group(2))))
    return steps


def _consumed_tokens(files: dict[int, Path], lengths: dict[int, int], sample_order: Sequence[int] | None,
                     *, seed: int, samples_per_step: int, batch_size: int, steps: int, max_len: int) -> list[int]:
    """Real (unpadded) tokens of each optimizer step, from the order SpecForge visits the files in."""
    if sample_order is not None:
        visited = list(sample_order)
    else:
        ids = [i for _, i in sorted((str(p.absolute()), i) for i, p in files.items())]
        per_epoch = len(ids) // batch_size * batch_size  # drop_last
        visited = []
        epoch = 0
        while len(visited) < steps * samples_per_step:
            visited += [ids[k] for k in specforge_epoch_order(len(ids), seed, epoch)][:per_epoch]
            epoch += 1
    clipped = [min(lengths[i], max_len) for i in visited[: steps * samples_per_step]]
    return [sum(clipped[s * samples_per_step:(s + 1) * samples_per_step]) for s in range(steps)]


def _shims(cpu: bool, patch_optimizer: bool, betas: Sequence[float], weight_decay: float,
           min_lr_ratio: float) -> dict[str, Any]:
    """The patches the subprocess needs (empty on CUDA with SpecForge's own optimizer knobs)."""
    shims: dict[str, Any] = {}
    if cpu:
        shims["cpu-loss"] = True
    unmatched = {k: v for k, v in {"betas": tuple(betas), "weight_decay": weight_decay,
                                   "min_lr_ratio": min_lr_ratio}.items()
                 if v != {"betas": SPECFORGE_BETAS, "weight_decay": SPECFORGE_WEIGHT_DECAY,
                          "min_lr_ratio": 0.0}[k]}
    if unmatched and not patch_optimizer:
        raise SpecForgeRunError(
            f"SpecForge has no knob for {sorted(unmatched)} (it uses AdamW betas {SPECFORGE_BETAS}, "
            f"weight_decay {SPECFORGE_WEIGHT_DECAY}, cosine to 0): set hsstore's recipe to those, "
            "or pass patch_optimizer=True to patch SpecForge's BF16Optimizer (a shim)")
    if patch_optimizer:
        shims["optimizer"] = {"betas": list(betas), "weight_decay": weight_decay, "min_lr_ratio": min_lr_ratio}
    return shims


def train_specforge(features_dir: Path, draft_config: Path, vocab_mapping: Path, target_dir: Path,
                    out_dir: Path, *, steps: int, lr: float, warmup_steps: int, min_lr_ratio: float = 0.0,
                    ttt_length: int = 7, max_len: int, batch_size: int, seed: int, device: str = "cuda",
                    grad_clip: float, betas: Sequence[float] = SPECFORGE_BETAS,
                    weight_decay: float = SPECFORGE_WEIGHT_DECAY, accumulation_steps: int = 1,
                    sample_order: Sequence[int] | None = None, patch_optimizer: bool = False,
                    attention_backend: str | None = None, log_interval: int = 1,
                    dataloader_num_workers: int | None = None, align_loss_mask: bool = False) -> dict[str, Any]:
    """Train with ``specforge train`` in a subprocess, export with ``specforge export --to hf``.

    ``vocab_mapping``: hsstore's exported draft (dir or safetensors, its ``d2t``/``t2d``) or a
    SpecForge ``.pt`` mapping. ``sample_order``: sample ids to train on, in order (one epoch of
    SpecForge; at least ``steps * batch_size * accumulation_steps`` of them); None: SpecForge's own
    shuffled epochs. ``device``: ``cpu``, ``cuda`` or ``cuda:N``. ``log_interval`` must divide
    ``steps`` (tokens/s comes from SpecForge's per-window step times). ``align_loss_mask``: train
    on copies whose loss mask is shifted so that SpecForge scores hsstore's positions
    (:func:`aligned_loss_mask_copy`; a data shim, off by default).

    Returns ``export_dir``, ``tokens_per_s`` (real tokens / ``train_seconds``, SpecForge's wall time
    from its first to its last step: reads, compute, optimizer; not its start-up),
    ``steady_tokens_per_s`` (the first logged window, with compilation, left out), ``train_seconds``,
    ``wall_seconds`` (the whole subprocess), ``steps``, ``num_tokens``, ``final_loss``,
    ``final_acc`` (per depth), ``metrics`` (every logged step), ``shims``, ``config``.
    """
    out_dir, target_dir = Path(out_dir).resolve(), Path(target_dir).resolve()
    if steps % log_interval:
        raise SpecForgeRunError(f"log_interval={log_interval} must divide steps={steps}")
    cpu = device == "cpu"
    shims = _shims(cpu, patch_optimizer, betas, weight_decay, min_lr_ratio)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = feature_files(features_dir)
    samples_per_step = batch_size * accumulation_steps
    data_shims = []
    if align_loss_mask:  # a data shim: SpecForge then scores the positions hsstore scores
        data_shims.append(ALIGNED_LOSS_MASK_SHIM)
        files = aligned_loss_mask_copy(files, list(sample_order or files), out_dir / "aligned_features")
        features_dir = out_dir / "aligned_features"
    if sample_order is not None:
        if len(sample_order) < steps * samples_per_step:
            raise SpecForgeRunError(f"sample_order has {len(sample_order)} samples; {steps} steps of "
                                    f"{samples_per_step} need {steps * samples_per_step}")
        sample_order = list(sample_order)[: steps * samples_per_step]
        features_dir = ordered_view(files, sample_order, seed, out_dir / "ordered_features")
        num_epochs = 1
    else:
        per_epoch = len(files) // batch_size // accumulation_steps
        if per_epoch == 0:
            raise SpecForgeRunError(f"{len(files)} samples make no step of {samples_per_step}")
        num_epochs = math.ceil(steps / per_epoch)
    mapping = Path(vocab_mapping)
    if mapping.suffix != ".pt":
        mapping = write_vocab_mapping(mapping, out_dir / "vocab_mapping.pt")
    config = specforge_config(
        features_dir=Path(features_dir).resolve(), draft_config=Path(draft_config).resolve(),
        vocab_mapping=mapping.resolve(), target_dir=target_dir, out_dir=out_dir, steps=steps,
        num_epochs=num_epochs, lr=lr, warmup_steps=warmup_steps, ttt_length=ttt_length, max_len=max_len,
        batch_size=batch_size, accumulation_steps=accumulation_steps, seed=seed, grad_clip=grad_clip, cpu=cpu,
        attention_backend=attention_backend, log_interval=log_interval,
        dataloader_num_workers=dataloader_num_workers)
    config_path = out_dir / "specforge.yaml"
    import yaml

    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    train_cmd = ([sys.executable, str(SHIMS_SCRIPT), "--shims", json.dumps(shims)] if shims
                 else [sys.executable, "-m", "specforge.cli"]) + ["train", "-c", str(config_path)]
    wall_seconds = _run(train_cmd, out_dir / "specforge_train.log", env, out_dir)
    metrics = parse_step_metrics((out_dir / "specforge_train.log").read_text(errors="replace"))
    if not metrics or metrics[-1][0] != steps:
        raise SpecForgeRunError(f"{out_dir / 'specforge_train.log'}: logged steps {[s for s, _ in metrics]}, "
                                f"expected up to {steps}")
    export_dir = _export(out_dir, steps, Path(draft_config).resolve(), mapping.resolve(), target_dir, env)
    tokens = _consumed_tokens(files, sample_lengths(files), sample_order, seed=seed,
                              samples_per_step=samples_per_step, batch_size=batch_size, steps=steps,
                              max_len=max_len)
    window_s = [m["perf/optimizer_step_time_s"] * log_interval for _, m in metrics]
    window_tokens = [sum(tokens[s - log_interval:s]) for s, _ in metrics]
    steady_s, steady_tokens = sum(window_s[1:]), sum(window_tokens[1:])
    final = metrics[-1][1]
    result = {
        "export_dir": str(export_dir), "steps": steps, "num_tokens": sum(tokens),
        "train_seconds": sum(window_s), "wall_seconds": wall_seconds,
        "tokens_per_s": sum(tokens) / sum(window_s),
        "steady_tokens_per_s": steady_tokens / steady_s if steady_s > 0 else None,
        "final_loss": float(final["loss"]),
        "final_acc": [float(final[f"acc_{i}"]) for i in range(ttt_length)],
        "metrics": [{"step": s, **m} for s, m in metrics],
        "shims": sorted(shims) + data_shims
        + (["config: fsdp_sharding=NO_SHARD, attention_backend=sdpa"] if cpu else []),
        "config": str(config_path),
    }
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _export(out_dir: Path, steps: int, draft_config: Path, mapping: Path, target_dir: Path,
            env: dict[str, str]) -> Path:
    """``specforge export --to hf`` of the run's final checkpoint, with the target's embedding."""
    checkpoint = out_dir / "train" / f"{RUN_ID}-step{steps}"
    if not checkpoint.is_dir():
        raise SpecForgeRunError(f"{checkpoint}: SpecForge wrote no final checkpoint there")
    export_dir = out_dir / "export"
    cmd = [sys.executable, "-m", "specforge.cli", "export", "--to", "hf", "--checkpoint", str(checkpoint),
           "--draft-config", str(draft_config), "--output-dir", str(export_dir),
           "--vocab-mapping", str(mapping), "--embedding-source", str(target_dir)]
    _run(cmd, out_dir / "specforge_export.log", env, out_dir)
    return export_dir
