"""The training loop: stream packed batches from the store, fit the draft, checkpoint, resume.

Reads top to bottom like nanoGPT's train.py: setup (distributed, store, lineage, target heads,
draft vocabulary, draft, optimizer, loader), then one loop that does, per step: wait for a batch
(timed: the data-wait fraction), decode it on the device, build the teacher, run the TTT unroll (or
the candidate head's KL for stage 2), step AdamW with warmup+cosine and clipping, log, checkpoint.

DDP: ``torchrun --nproc_per_node N -m pipelines.cli train RECIPE`` (gloo on CPU, NCCL on GPU).
The draft is not wrapped in DistributedDataParallel because the TTT unroll calls several of its
methods, not one ``forward``; gradients are summed across ranks by hand after backward instead.
The loss is normalised by the *global* count of scored positions at each depth, so N ranks compute
exactly the gradient of one rank seeing all N batches.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hsstore
from hsstore.loader import LoaderState, StreamingLoader
from hsstore.torch_data import DeviceBatch, WaitTimer, to_device
from pipelines.models.checkpoint import (
    init_from_pretrained,
    load_draft,
    read_draft_config,
    resolve_draft_dir,
)
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.recipe import dump_recipe
from pipelines.train import checkpoint as ckpt
from pipelines.train.candidate import attach_candidate_head, candidate_step_loss
from pipelines.train.config import TrainRecipe
from pipelines.train.lineage_check import TEACHER_FEATURES, check_lineage, choose_teacher
from pipelines.train.target_heads import TargetHeads, load_target_heads
from pipelines.train.teacher import build_teacher
from pipelines.train.ttt import ttt_forward, ttt_step_masks, ttt_unroll
from pipelines.train.vocab import (
    DraftVocab,
    calibrate_vocab,
    count_loss_tokens_in_table,
    read_vocab_file,
    write_vocab_file,
)

logger = logging.getLogger(__name__)
AUX = "aux_hidden_states"


# -- setup helpers ---------------------------------------------------------------------------


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # we initialised the process group, so we tear it down
    device: torch.device = torch.device("cpu")  # where collectives run (NCCL needs CUDA tensors)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_pref: str) -> tuple[Distributed, torch.device]:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) -> process group and device."""
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_pref.startswith("cuda") or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        index = int(device_pref.split(":")[1]) if ":" in device_pref else local_rank
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        owns = True
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return Distributed(rank, world_size, local_rank, owns, device), device


def all_reduce_(tensor: torch.Tensor, dist_state: Distributed) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (a no-op on one process)."""
    if dist_state.world_size > 1:
        import torch.distributed as dist

        if tensor.device != dist_state.device:
            on_device = tensor.to(dist_state.device)
            dist.all_reduce(on_device)
            tensor.copy_(on_device)
        else:
            dist.all_reduce(tensor)
    return tensor


def lr_at(step: int, total_steps: int, recipe: TrainRecipe) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from the peak to ``min_lr_ratio * peak``."""
    peak, warmup = recipe.optimizer.lr, recipe.schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = recipe.schedule.min_lr_ratio
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def draft_vocabulary(recipe: TrainRecipe, store: hsstore.Store, vocab_size: int) -> DraftVocab:
    """Calibrated from the store's loss-masked token counts, read from a file, or the full vocab."""
    vocab = recipe.draft.vocab
    if vocab.full:
        return DraftVocab.full(vocab_size)
    if vocab.vocab_file is not None:
        return read_vocab_file(vocab.vocab_file, vocab_size)
    assert vocab.draft_vocab_size is not None
    counts = count_loss_tokens_in_table(store.samples, vocab_size)
    return calibrate_vocab(counts, min(vocab.draft_vocab_size, vocab_size))


def build_draft(
    recipe: TrainRecipe, store: hsstore.Store, heads: TargetHeads, output_dir: Path, is_main: bool
) -> Eagle3Draft:
    """A fresh stage-1 draft (vocab calibrated, embeddings copied, optionally ``init_from``) or, for
    stage 2, the frozen stage-1 draft with a candidate head initialised from its lm_head's SVD."""
    if recipe.stage == "candidate_head":
        assert recipe.candidate_head.draft_checkpoint is not None
        draft = load_draft(recipe.candidate_head.draft_checkpoint, embed_tokens=heads.embed_tokens_VH.float())
        attach_candidate_head(draft, recipe.candidate_head.rank, recipe.candidate_head.num_candidates)
        return draft
    from transformers import AutoConfig

    vocab = draft_vocabulary(recipe, store, heads.vocab_size)
    if is_main:
        write_vocab_file(vocab, output_dir / "draft_vocab.json")
    sizes = recipe.draft.model_dump(exclude={"vocab", "sliding_window"}, exclude_none=True)
    config = Eagle3Config.from_target_config(
        AutoConfig.from_pretrained(recipe.target),
        draft_vocab_size=vocab.draft_vocab_size,
        aux_layer_ids=list(store.lineage.aux_layer_ids),
        sliding_window=recipe.draft.sliding_window,
        **sizes,
    )
    draft = Eagle3Draft(config)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(heads.embed_tokens_VH)
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    if recipe.init_from is not None:
        loaded = init_from_pretrained(draft, recipe.init_from)
        logger.info("init_from %s: loaded %d tensors", recipe.init_from, len(loaded))
    return draft


def continued_draft_aux_ids(recipe: TrainRecipe) -> list[int] | None:
    """Aux layers of a draft this run continues (init_from / stage-1), for the lineage check."""
    path = recipe.candidate_head.draft_checkpoint if recipe.stage == "candidate_head" else recipe.init_from
    if path is None or not Path(path).is_dir():
        return None
    return list(read_draft_config(resolve_draft_dir(path)).aux_layer_ids)


class _Preemption:
    """SIGTERM/SIGINT set a flag; the loop checkpoints at the end of the step and returns."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        logger.warning("signal %d: checkpointing after this step, then stopping", signum)
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# -- one step ---------------------------------------------------------------------------------


def train_step_draft(
    draft: Eagle3Draft, batch: DeviceBatch, heads: TargetHeads, teacher_mode: str, recipe: TrainRecipe,
    dist_state: Distributed, autocast: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 1: the TTT loss against the target's distribution over the draft vocabulary."""
    with torch.no_grad():
        teacher = build_teacher(teacher_mode, batch.features, d2t=draft.d2t, t2d=draft.t2d, lm_head_VH=heads.lm_head_VH)
    with autocast:
        out = ttt_forward(
            draft, batch.features[AUX], batch.input_ids, batch.position_ids, batch.loss_mask,
            teacher.probs_BTV, teacher.valid_BT, batch.doc_ids, recipe.ttt_length, recipe.loss_decay,
        )
    counts = all_reduce_(torch.stack(out.step_counts).to(torch.float64), dist_state)
    loss = sum(
        recipe.loss_decay**i * out.step_loss_sums[i] / counts[i].clamp(min=1).to(out.step_loss_sums[i].dtype)
        for i in range(recipe.ttt_length)
    )
    stats = {
        "loss": loss.detach().double(),
        "correct": torch.stack(out.step_correct).double(),
        "count": torch.stack(out.step_counts).double(),
    }
    return loss, stats  # type: ignore[return-value]


def train_step_candidate(
    draft: Eagle3Draft, batch: DeviceBatch, recipe: TrainRecipe, dist_state: Distributed, autocast: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 2: forward KL from the frozen full head to the low-rank head at every depth."""
    with torch.no_grad(), autocast:
        hidden = ttt_unroll(draft, batch.features[AUX], batch.input_ids, batch.position_ids, batch.doc_ids, recipe.ttt_length)
    masks = ttt_step_masks(batch.loss_mask, batch.doc_remaining, None, recipe.ttt_length)
    with autocast:
        out = candidate_step_loss(draft, hidden, masks, recipe.candidate_head.num_candidates, recipe.loss_decay)
    counts = all_reduce_(torch.stack(out.step_counts).to(torch.float64), dist_state)
    weights = [recipe.loss_decay**i for i in range(recipe.ttt_length)]
    loss = sum(w * out.step_kl_sums[i] / counts[i].clamp(min=1).float() for i, w in enumerate(weights)) / sum(weights)
    stats = {
        "loss": loss.detach().double(),
        "correct": torch.stack(out.step_hits).double(),
        "count": torch.stack(out.step_counts).double(),
        "kl": torch.stack([k.detach() for k in out.step_kl_sums]).double(),
    }
    return loss, stats  # type: ignore[return-value]


# -- the run ----------------------------------------------------------------------------------


def run_training(recipe: TrainRecipe, *, stop_at_step: int | None = None) -> dict[str, Any]:
    """Train as the recipe says; returns the summary (also written to ``output_dir/summary.json``).

    ``stop_at_step`` stops after that global step with a checkpoint, as a preemption would (tests
    use it to check that resuming reproduces an uninterrupted run exactly).
    """
    dist_state, device = setup_distributed(recipe.device)
    try:
        return _run(recipe, dist_state, device, stop_at_step)
    finally:
        if dist_state.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(recipe: TrainRecipe, dist_state: Distributed, device: torch.device, stop_at_step: int | None) -> dict[str, Any]:
    output_dir = Path(recipe.output_dir)
    ckpt_root = output_dir / "checkpoints"
    if dist_state.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, output_dir / "recipe.yaml")
    torch.manual_seed(recipe.seed)

    # Store and lineage: refuse a mismatched store before anything is computed.
    store = hsstore.open_store(recipe.store)
    teacher_mode = choose_teacher(store, recipe.teacher)
    lineage = check_lineage(
        store, recipe.target, expect_aux_layer_ids=recipe.expect_aux_layer_ids,
        draft_aux_layer_ids=continued_draft_aux_ids(recipe), hash_weights=recipe.verify_weights,
    )
    logger.info("lineage ok: %s", lineage)

    # What of the target is needed: embed_tokens (draft input) and lm_head (the teacher).
    heads_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    heads = load_target_heads(recipe.target, dtype=heads_dtype).to(device)

    resume_from = ckpt.latest_checkpoint(ckpt_root) if recipe.resume else None
    if resume_from is not None:
        draft = load_draft(resume_from, device=device)
        if recipe.stage == "candidate_head":
            # The head's config (rank, K) came back with the checkpoint; only the head trains.
            for param in draft.parameters():
                param.requires_grad_(False)
            assert draft.candidate_head is not None
            for param in draft.candidate_head.parameters():
                param.requires_grad_(True)
        state = ckpt.read_state(resume_from)
        logger.info("resuming from %s (step %d)", resume_from, state["step"])
    else:
        draft = build_draft(recipe, store, heads, output_dir, dist_state.is_main)
        state = None
    draft.embed_tokens.weight.requires_grad_(False)
    draft = draft.to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=recipe.optimizer.lr, betas=recipe.optimizer.betas, eps=recipe.optimizer.eps,
        weight_decay=recipe.optimizer.weight_decay,
    )
    if resume_from is not None:
        ckpt.load_optimizer(optimizer, resume_from, device)

    # The loader: teacher features only for stage 1 (stage 2's teacher is the draft's own head).
    features = [AUX] + (list(TEACHER_FEATURES[teacher_mode]) if recipe.stage == "draft" else [])
    settings = recipe.loader
    loader = StreamingLoader(
        store, features, token_budget=settings.token_budget, rows_per_batch=settings.rows_per_batch,
        seed=recipe.seed, shuffle_window=settings.shuffle_window, rank=dist_state.rank,
        world_size=dist_state.world_size, remainder=settings.remainder, long_samples=settings.long_samples,
        read_threads=settings.read_threads, prefetch_batches=settings.prefetch_batches,
        skip_corrupt=recipe.skip_corrupt,
        # Training on the CPU: fp8 features are decoded by the read threads, overlapping the step;
        # a GPU decodes them for free and the host moves half the bytes.
        decode_on_host=device.type == "cpu",
    )
    total_steps = recipe.max_steps or sum(loader.num_batches(e) for e in range(recipe.schedule.epochs))
    step = 0
    loader_state = loader.initial_state()
    totals = {"tokens": 0, "padding": 0, "wait_s": 0.0, "step_s": 0.0, "skipped": 0}
    if state is not None:
        step = int(state["step"])
        loader_state = LoaderState.from_dict(state["loader"])
        totals.update(state.get("totals", {}))
    if settings.num_workers > 0:
        from hsstore.torch_data import make_dataloader

        batches = iter(make_dataloader(
            store.url, features, loader_state, num_workers=settings.num_workers,
            token_budget=settings.token_budget, rows_per_batch=settings.rows_per_batch, seed=recipe.seed,
            shuffle_window=settings.shuffle_window, rank=dist_state.rank, world_size=dist_state.world_size,
            remainder=settings.remainder, long_samples=settings.long_samples, read_threads=settings.read_threads,
            prefetch_batches=settings.prefetch_batches, skip_corrupt=recipe.skip_corrupt,
            decode_on_host=loader.decode_on_host,
        ))
    else:
        batches = loader.batches(loader_state)
    timer = WaitTimer(batches)
    specs = loader.specs

    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if recipe.bf16 and device.type == "cuda" else nullcontext()
    )
    metrics_path = output_dir / "metrics.jsonl"
    window: dict[str, Any] = {}
    last_log: dict[str, Any] = {}
    progress = None
    if dist_state.is_main:
        from tqdm.auto import tqdm

        progress = tqdm(total=total_steps, initial=step, desc=f"train {recipe.stage}", unit="step", dynamic_ncols=True)

    def checkpoint(name: str) -> Path:
        saved = {
            "step": step, "loader": loader_state.to_dict(), "totals": totals, "stage": recipe.stage,
            "model": recipe.model, "teacher": teacher_mode, "world_size": dist_state.world_size,
            "total_steps": total_steps, "recipe": recipe.model_dump(mode="json"), "lineage": lineage,
        }
        path = ckpt_root / name
        if dist_state.is_main:
            path = ckpt.save_checkpoint(ckpt_root, name, draft, optimizer, saved)
            ckpt.prune_checkpoints(ckpt_root, recipe.keep_checkpoints)
        if dist_state.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
        return path

    interrupted = False
    loop_started = time.perf_counter()
    with _Preemption() as preemption:
        while step < total_steps:
            step_started = time.perf_counter()
            host = next(timer)
            batch = to_device(host, specs, device, pin_memory=device.type == "cuda")
            if device.type == "cpu":  # CPU bf16 matmuls are slow; features go in as float32
                batch.features = {k: v.float() if v.is_floating_point() else v for k, v in batch.features.items()}
            lr = lr_at(step, total_steps, recipe)
            for group in optimizer.param_groups:
                group["lr"] = lr

            if recipe.stage == "draft":
                loss, stats = train_step_draft(draft, batch, heads, teacher_mode, recipe, dist_state, autocast)
            else:
                loss, stats = train_step_candidate(draft, batch, recipe, dist_state, autocast)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for param in params:
                if param.grad is not None:
                    all_reduce_(param.grad, dist_state)
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(params, recipe.optimizer.grad_clip)
                if recipe.optimizer.grad_clip is not None
                else torch.zeros(())
            )
            optimizer.step()
            step += 1
            loader_state = loader.state_after(host)

            if device.type == "cuda":
                torch.cuda.synchronize(device)
            totals["tokens"] += batch.num_real_tokens
            totals["padding"] += batch.num_padding_tokens
            totals["wait_s"] += timer.last_wait
            totals["step_s"] += time.perf_counter() - step_started
            totals["skipped"] += batch.num_skipped_samples
            _accumulate(window, stats, batch, timer.last_wait, time.perf_counter() - step_started, float(grad_norm))

            if step % recipe.log_every == 0 or step == total_steps:
                last_log = _log(window, step, lr, host.epoch, recipe, dist_state, metrics_path)
                window = {}
                if progress is not None:
                    progress.set_postfix(loss=f"{last_log['loss']:.3f}", acc0=f"{last_log['acc'][0]:.3f}")
            if progress is not None:
                progress.update(1)
            if recipe.checkpoint_every and step % recipe.checkpoint_every == 0 and step < total_steps:
                checkpoint(ckpt.step_dir_name(step))
            stop_now = all_reduce_(torch.tensor([float(preemption.requested)]), dist_state)  # all stop together
            if (stop_at_step is not None and step >= stop_at_step and step < total_steps) or bool(stop_now.item()):
                if window:
                    last_log = _log(window, step, lr, host.epoch, recipe, dist_state, metrics_path)
                checkpoint(ckpt.step_dir_name(step))
                interrupted = True
                break
    if progress is not None:
        progress.close()
    final_path = ckpt_root / ckpt.FINAL_NAME
    if not interrupted:
        final_path = checkpoint(ckpt.FINAL_NAME)
    loop_s = time.perf_counter() - loop_started
    summary = _summary(recipe, step, total_steps, totals, last_log, loader, dist_state, interrupted, final_path, loop_s)
    if dist_state.is_main:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(_summary_text(summary))
    return summary


def _accumulate(window: dict[str, Any], stats: dict[str, torch.Tensor], batch: DeviceBatch, wait_s: float,
                step_s: float, grad_norm: float) -> None:
    for key, value in stats.items():
        value = value.detach().cpu()
        window[key] = window[key] + value if key in window else value.clone()
    window["steps"] = window.get("steps", 0) + 1
    window["tokens"] = window.get("tokens", 0) + batch.num_real_tokens
    window["padding"] = window.get("padding", 0) + batch.num_padding_tokens
    window["wait_s"] = window.get("wait_s", 0.0) + wait_s
    window["step_s"] = window.get("step_s", 0.0) + step_s
    window["grad_norm"] = grad_norm


def _log(window: dict[str, Any], step: int, lr: float, epoch: int, recipe: TrainRecipe,
         dist_state: Distributed, metrics_path: Path) -> dict[str, Any]:
    """Reduce the window's sums over ranks and append one JSONL line (rank 0)."""
    keys = [k for k in ("loss", "correct", "count", "kl") if k in window]
    flat = torch.cat([window[k].reshape(-1) for k in keys] + [torch.tensor(
        [window["tokens"], window["padding"], window["wait_s"], window["step_s"]], dtype=torch.float64)])
    flat = all_reduce_(flat, dist_state)
    parts, offset = {}, 0
    for k in keys:
        n = window[k].numel()
        parts[k] = flat[offset : offset + n]
        offset += n
    tokens, padding, wait_s, step_s = flat[offset:].tolist()
    steps = window["steps"]
    count = parts["count"].clamp(min=1)
    record: dict[str, Any] = {
        "step": step,
        "epoch": epoch,
        "lr": lr,
        "loss": float(parts["loss"].sum()) / steps,
        "acc" if recipe.stage == "draft" else "recall": [round(float(x), 6) for x in parts["correct"] / count],
        "positions": [int(x) for x in parts["count"]],
        "tokens": int(tokens),
        # step_s is summed over ranks: per-rank wall time is step_s / world_size.
        "tokens_per_s": tokens / max(step_s / dist_state.world_size, 1e-9),
        "data_wait_frac": wait_s / max(step_s, 1e-9),
        "padding_frac": padding / max(tokens + padding, 1),
        "grad_norm": window["grad_norm"],
    }
    if "kl" in parts:
        record["kl"] = [round(float(x), 6) for x in parts["kl"] / count]
    if recipe.stage != "draft":
        record["acc"] = record["recall"]
    if dist_state.is_main:
        with metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
    return record


def _summary(recipe: TrainRecipe, step: int, total_steps: int, totals: dict[str, Any], last_log: dict[str, Any],
             loader: StreamingLoader, dist_state: Distributed, interrupted: bool, final_path: Path,
             loop_s: float) -> dict[str, Any]:
    plan = loader.plan(0)
    # Over all ranks: tokens add up; step time is per rank, so tokens/s uses the mean rank time.
    reduced = all_reduce_(torch.tensor([totals["tokens"], totals["wait_s"], totals["step_s"]], dtype=torch.float64), dist_state)
    tokens, wait_s, step_s = int(reduced[0]), float(reduced[1]), float(reduced[2])
    return {
        "stage": recipe.stage,
        "model": recipe.model,
        "steps": step,
        "total_steps": total_steps,
        "interrupted": interrupted,
        "world_size": dist_state.world_size,
        "tokens": tokens,
        "tokens_per_s": tokens / max(step_s / dist_state.world_size, 1e-9),
        "data_wait_frac": wait_s / max(step_s, 1e-9),
        "padding_frac": plan.padding_fraction,
        "rows_dropped_per_epoch": plan.num_rows_dropped,
        "samples_truncated_per_epoch": plan.num_samples_truncated,
        "samples_skipped": totals["skipped"],
        "final_loss": last_log.get("loss"),
        "final_acc": last_log.get("acc"),
        "final_kl": last_log.get("kl"),
        "checkpoint": str(final_path) if not interrupted else str(ckpt.latest_checkpoint(final_path.parent)),
        "wall_s": loop_s,
    }


def _summary_text(summary: dict[str, Any]) -> str:
    acc = summary["final_acc"] or []
    what = "recall@K" if summary["stage"] == "candidate_head" else "acc"
    lines = [
        f"{'stopped' if summary['interrupted'] else 'done'}: {summary['steps']}/{summary['total_steps']} steps, "
        f"{summary['tokens']} tokens, {summary['tokens_per_s']:.0f} tokens/s, "
        f"data wait {100 * summary['data_wait_frac']:.1f}%, padding {100 * summary['padding_frac']:.1f}%",
        f"final loss {summary['final_loss']}, per-depth {what} " + " ".join(f"{a:.3f}" for a in acc),
        f"{'checkpoint' if summary['interrupted'] else 'final checkpoint'}: {summary['checkpoint']}",
    ]
    return "\n".join(lines)
