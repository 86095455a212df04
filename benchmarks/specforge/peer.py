"""Train an EAGLE-3 draft with SpecForge 0.2.0's own offline trainer, for side-by-side benchmarks.

``train_specforge`` runs ``specforge train`` (sgl-project's trainer, its offline EAGLE-3 path, as
a user runs it: a YAML config, one process) in a **subprocess** on a directory of features in
SpecForge's offline layout (``rows_<g>-<g+5000>/data_<i>.ckpt``: ``input_ids``/``loss_mask`` [T]
int64, ``hidden_state`` [1, T, H] after the target's final norm, ``aux_hidden_state`` [1, T, 3H]),
then ``specforge export --to hf``, whose directory loads through hsstore's
``pipelines.models.checkpoint.load_draft``. It returns the training tokens/s (real tokens, padding
excluded, over SpecForge's own per-step wall time: data reads included) and the export's path.

Requirements: ``pip install --no-deps specforge==0.2.0`` (it pins torch 2.11, transformers 5.8.1
and sglang 0.5.14; the offline path imports no sglang, and ran here on torch 2.13 (CPU) and
transformers 5.24) plus what that path imports: ``accelerate`` (its ``set_seed``), ``datasets``
(imported by ``specforge/data/utils.py``; with ``dill`` and ``multiprocess``), ``pydantic``,
``pyyaml``, ``safetensors``, ``huggingface_hub``, ``numpy``, ``tqdm`` and, on CUDA, ``triton``
(its loss kernel).
``tools/specforge_gpu_wheels.sh`` fetches what the GPU image lacks.

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

The code shims live in ``benchmarks/specforge/shims.py``, the script the subprocess runs when a
shim is needed (it applies them, then calls ``specforge.cli.main``).

On CUDA with SpecForge-compatible optimizer knobs nothing is patched: ``python -m specforge.cli``.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.specforge.data import (
    SpecForgeRunError,
    aligned_loss_mask_copy,
    feature_files,
    hsstore_sample_order,
    ordered_view,
    sample_lengths,
    specforge_epoch_order,
    write_features_from_store,
    write_vocab_mapping,
)

__all__ = [
    "SpecForgeRunError", "aligned_loss_mask_copy", "feature_files", "hsstore_sample_order", "ordered_view",
    "sample_lengths", "specforge_epoch_order", "train_specforge", "write_features_from_store",
    "write_vocab_mapping",
]

SPECFORGE_BETAS = (0.9, 0.999)  # torch.optim.AdamW's default, used by specforge.optimizer
SPECFORGE_WEIGHT_DECAY = 0.0
_OUR_ENTRIES = {"specforge.yaml", "train", "export", "ordered_features", "aligned_features", "cache",
                "vocab_mapping.pt", "result.json", "specforge_train.log", "specforge_export.log"}
_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_ID = "specforge-run"
ALIGNED_LOSS_MASK_SHIM = "aligned-loss-mask: loss_mask shifted left by two in a copy of the features"
SHIMS_SCRIPT = Path(__file__).resolve().with_name("shims.py")  # runs in the subprocess, as a script
_STEP_LINE = re.compile(r"^step (\d+): (\{.*\})\s*$")


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
                    dataloader_num_workers: int | None = None, align_loss_mask: bool = False,
                    overwrite: bool = False) -> dict[str, Any]:
    """Train with ``specforge train`` in a subprocess, export with ``specforge export --to hf``.

    ``vocab_mapping``: hsstore's exported draft (dir or safetensors, its ``d2t``/``t2d``) or a
    SpecForge ``.pt`` mapping. ``sample_order``: sample ids to train on, in order (one epoch of
    SpecForge; at least ``steps * batch_size * accumulation_steps`` of them); None: SpecForge's own
    shuffled epochs. ``device``: ``cpu``, ``cuda`` or ``cuda:N``. ``log_interval`` must divide
    ``steps`` (tokens/s comes from SpecForge's per-window step times). ``align_loss_mask``: train
    on copies whose loss mask is shifted so that SpecForge scores hsstore's positions
    (:func:`aligned_loss_mask_copy`; a data shim, off by default). A previous run in ``out_dir``
    is removed first (SpecForge would silently resume from its checkpoint); other content is
    refused unless ``overwrite``.

    Returns ``export_dir``, ``tokens_per_s`` (real tokens / ``train_seconds``, SpecForge's wall time
    from its first to its last step: reads, compute, optimizer; not its start-up),
    ``steady_tokens_per_s`` (the first logged window, with compilation, left out), ``train_seconds``,
    ``wall_seconds`` (the whole subprocess), ``steps``, ``num_tokens``, ``final_loss``,
    ``final_acc`` (per depth), ``metrics`` (every logged step), ``shims``, ``config``.
    """
    out_dir, target_dir = Path(out_dir).resolve(), Path(target_dir).resolve()
    if steps % log_interval:
        raise SpecForgeRunError(f"log_interval={log_interval} must divide steps={steps}")
    _clear_previous_run(out_dir, overwrite)
    cpu = device == "cpu"
    shims = _shims(cpu, patch_optimizer, betas, weight_decay, min_lr_ratio)
    samples_per_step = batch_size * accumulation_steps
    files, features_dir, sample_order, num_epochs = _training_files(
        Path(features_dir), out_dir, sample_order, seed=seed, steps=steps, batch_size=batch_size,
        samples_per_step=samples_per_step, align_loss_mask=align_loss_mask)
    mapping = write_vocab_mapping(vocab_mapping, out_dir / "vocab_mapping.pt")
    config = specforge_config(
        features_dir=features_dir.resolve(), draft_config=Path(draft_config).resolve(), vocab_mapping=mapping,
        target_dir=target_dir, out_dir=out_dir, steps=steps, num_epochs=num_epochs, lr=lr,
        warmup_steps=warmup_steps, ttt_length=ttt_length, max_len=max_len, batch_size=batch_size,
        accumulation_steps=accumulation_steps, seed=seed, grad_clip=grad_clip, cpu=cpu,
        attention_backend=attention_backend, log_interval=log_interval,
        dataloader_num_workers=dataloader_num_workers)
    config_path = out_dir / "specforge.yaml"
    config_path.write_text(yaml_dump(config))
    # One process: SpecForge's CLI makes its own 1-rank group (gloo/nccl) when these are unset,
    # and refuses a partial set a parent's torch.distributed run may have left behind.
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARS}
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
    export_dir = _export(out_dir, steps, Path(draft_config).resolve(), mapping, target_dir, env)
    tokens = _consumed_tokens(files, sample_lengths(files), sample_order, seed=seed,
                              samples_per_step=samples_per_step, batch_size=batch_size, steps=steps,
                              max_len=max_len)
    result = {
        "export_dir": str(export_dir), "wall_seconds": wall_seconds, "config": str(config_path),
        **_throughput(metrics, tokens, log_interval),
        "final_loss": float(metrics[-1][1]["loss"]),
        "final_acc": [float(metrics[-1][1][f"acc_{i}"]) for i in range(ttt_length)],
        "metrics": [{"step": s, **m} for s, m in metrics],
        "shims": sorted(shims) + ([ALIGNED_LOSS_MASK_SHIM] if align_loss_mask else [])
        + (["config: fsdp_sharding=NO_SHARD, attention_backend=sdpa"] if cpu else []),
    }
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _clear_previous_run(out_dir: Path, overwrite: bool) -> None:
    """Remove what an earlier ``train_specforge`` left in ``out_dir`` (SpecForge would otherwise
    resume from its checkpoint); anything else there is refused unless ``overwrite``."""
    if out_dir.exists():
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in _OUR_ENTRIES)
        if foreign and not overwrite:
            raise SpecForgeRunError(f"{out_dir} holds {foreign[:5]}, not a train_specforge run; "
                                    "pass overwrite=True to replace it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)


def yaml_dump(config: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)


def _training_files(features_dir: Path, out_dir: Path, sample_order: Sequence[int] | None, *, seed: int,
                    steps: int, batch_size: int, samples_per_step: int, align_loss_mask: bool,
                    ) -> tuple[dict[int, Path], Path, list[int] | None, int]:
    """``(files, the directory SpecForge reads, the order trained, epochs)``: the features as given,
    or their loss-mask-aligned copies, seen through an ordered view when an order is given."""
    files = feature_files(features_dir)
    if align_loss_mask:
        files = aligned_loss_mask_copy(files, list(sample_order or files), out_dir / "aligned_features")
        features_dir = out_dir / "aligned_features"
    if sample_order is None:
        per_epoch = len(files) // samples_per_step
        if per_epoch == 0:
            raise SpecForgeRunError(f"{len(files)} samples make no step of {samples_per_step}")
        return files, features_dir, None, math.ceil(steps / per_epoch)
    if len(sample_order) < steps * samples_per_step:
        raise SpecForgeRunError(f"sample_order has {len(sample_order)} samples; {steps} steps of "
                                f"{samples_per_step} need {steps * samples_per_step}")
    order = list(sample_order)[: steps * samples_per_step]
    return files, ordered_view(files, order, seed, out_dir / "ordered_features"), order, 1


def _throughput(metrics: list[tuple[int, dict[str, Any]]], tokens: list[int], log_interval: int) -> dict[str, Any]:
    """Tokens/s over SpecForge's logged windows (``perf/optimizer_step_time_s`` is a window's wall
    time per step), overall and without the first window (compilation, warm-up)."""
    window_s = [m["perf/optimizer_step_time_s"] * log_interval for _, m in metrics]
    window_tokens = [sum(tokens[s - log_interval:s]) for s, _ in metrics]
    steady_s, steady_tokens = sum(window_s[1:]), sum(window_tokens[1:])
    return {
        "steps": metrics[-1][0], "num_tokens": sum(tokens), "train_seconds": sum(window_s),
        "tokens_per_s": sum(tokens) / sum(window_s),
        "steady_tokens_per_s": steady_tokens / steady_s if steady_s > 0 else None,
    }


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
