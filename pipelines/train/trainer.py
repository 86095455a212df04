"""The training loop: stream packed batches from the store, fit the stage's model, checkpoint, resume.

Reads top to bottom like nanoGPT's train.py. :func:`setup` does everything before step 1, in order:
the store and its lineage, the target's heads, the stage's model (or the checkpoint's), its
objective, AdamW, the loader. :func:`train` is the loop: per optimizer step and for each of
``grad_accum_steps`` micro-batches, wait for a batch (timed: the data-wait fraction), move it to
the device, run the objective and backpropagate; then clip, step AdamW with warmup+cosine, log,
checkpoint. What differs between stages (EAGLE-3/EAGLE-4 drafts, the candidate head) is the
stage plugin's (:mod:`pipelines.train.stages`): the features read, the model, the objective, the
loss, the metrics' names. Nothing here asks which stage runs.

DDP: ``torchrun --nproc_per_node N -m pipelines.cli train RECIPE`` (gloo on CPU, NCCL on GPU).
The objective is an ``nn.Module`` wrapped in ``DistributedDataParallel`` (bucketed all-reduce
overlapped with backward). Each micro-batch's loss is normalised by the *global* count of scored
positions at each depth (one small all-reduce before backward), so N ranks compute exactly the
gradient of one rank seeing all N batches. The loop keeps its statistics on the device and syncs
with the host only at log steps.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hsstore
from hsstore.batches import LoaderState
from hsstore.loader import StreamingLoader
from hsstore.read_cache import ReadCache
from hsstore.torch_data import WaitTimer
from pipelines.models.eagle3 import Eagle3Draft
from pipelines.recipe import dump_recipe
from pipelines.train import checkpoint as ckpt
from pipelines.train.compile_modes import check_compile_mode
from pipelines.train.config import TrainRecipe
from pipelines.train.data import LoaderSettings, batch_on_device, batch_stream, open_loader
from pipelines.train.distributed import (
    Distributed,
    all_reduce_,
    no_sync_unless,
    setup_distributed,
    wrap_ddp,
)
from pipelines.train.lineage_check import check_lineage, choose_teacher
from pipelines.train.metrics import MetricsWindow, append_record, summary_text
from pipelines.train.objective import loss_denominators
from pipelines.train.preemption import Preemption
from pipelines.train.stages import TrainingStage, compile_mode_for, scored_token_fraction, stage_for
from pipelines.train.target_heads import TargetHeads, load_target_heads
from pipelines.train.teacher_mode import TeacherMode

logger = logging.getLogger(__name__)


def lr_at(step: int, total_steps: int, recipe: TrainRecipe) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from the peak to ``min_lr_ratio * peak``."""
    peak, warmup = recipe.optimizer.lr, recipe.schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = recipe.schedule.min_lr_ratio
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Progress:
    """Where the run stands: what a checkpoint saves besides the weights, and resuming restores."""

    step: int
    loader_state: LoaderState  # the position after the last batch used
    # tokens, padding, wait_s, wall_s: summed over ranks from the log records; skipped: this rank's
    totals: dict[str, Any]

    @classmethod
    def restore(cls, saved: dict[str, Any] | None, start: LoaderState) -> Progress:
        totals: dict[str, Any] = {"tokens": 0, "padding": 0, "wait_s": 0.0, "wall_s": 0.0, "skipped": 0}
        if saved is None:
            return cls(0, start, totals)
        totals.update({k: v for k, v in saved.get("totals", {}).items() if k in totals})
        return cls(int(saved["step"]), LoaderState.from_dict(saved["loader"]), totals)


@dataclass
class TrainingRun:
    """Everything the loop drives, built by :func:`setup`."""

    recipe: TrainRecipe
    stage: TrainingStage
    dist_state: Distributed
    device: torch.device
    teacher: TeacherMode
    lineage: dict[str, Any]
    draft: Eagle3Draft
    model: nn.Module  # the stage's objective (DDP-wrapped on several ranks)
    params: list[nn.Parameter]  # the trainable ones
    optimizer: torch.optim.Optimizer
    loader: StreamingLoader
    batches: WaitTimer
    total_steps: int
    progress: Progress

    @property
    def output_dir(self) -> Path:
        return Path(self.recipe.output_dir)

    @property
    def ckpt_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def optimizer_step(self, lr: float, window: MetricsWindow) -> int:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns the last batch's epoch."""
        recipe, dist_state, accum = self.recipe, self.dist_state, self.recipe.grad_accum_steps
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for micro in range(accum):
            host = next(self.batches)
            batch = batch_on_device(host, self.loader, self.device)
            with no_sync_unless(micro == accum - 1, self.model):
                with autocast(recipe, self.device):
                    out = self.model(batch.features, batch.input_ids, batch.position_ids, batch.loss_mask, batch.doc_ids)
                counts = all_reduce_(torch.stack(out.counts).to(torch.float64), dist_state)
                denominators = loss_denominators(recipe.loss_normalization, counts, batch.num_real_tokens, dist_state)
                loss = self.stage.loss(out, denominators, dist_state.world_size)
                (loss / accum).backward()
            window.add_micro_batch(loss / dist_state.world_size, out, batch.num_real_tokens,
                                   batch.num_padding_tokens, self.batches.last_wait)
            self.progress.totals["skipped"] += batch.num_skipped_samples
            self.progress.loader_state = self.loader.state_after(host)
            host.release()  # the loader may refill its buffers (a GPU copy released them already)
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(self.params, recipe.optimizer.grad_clip)
            if recipe.optimizer.grad_clip is not None
            else torch.zeros((), device=self.device)
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        window.end_step(grad_norm)
        return host.epoch

    def log(self, window: MetricsWindow, epoch: int, lr: float, bar: Any | None) -> dict[str, Any]:
        """Reduce the window over ranks (a host sync) and append it to ``metrics.jsonl``."""
        record = window.reduce(self.progress.step, lr, epoch, self.dist_state)
        for key, value in window.reduced_totals.items():
            self.progress.totals[key] += value
        if self.dist_state.is_main:
            append_record(record, self.output_dir / "metrics.jsonl")
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.3f}")
        return record

    def checkpoint(self, name: str) -> Path:
        """Save the model, the optimizer and :class:`Progress` (rank 0 writes, every rank waits)."""
        recipe, progress = self.recipe, self.progress
        saved = {
            "step": progress.step, "loader": progress.loader_state.to_dict(), "totals": progress.totals,
            "stage": recipe.stage, "model": recipe.model, "teacher": self.teacher,
            "world_size": self.dist_state.world_size, "total_steps": self.total_steps,
            "recipe": recipe.model_dump(mode="json"), "lineage": self.lineage,
        }
        path = self.ckpt_root / name
        if self.dist_state.is_main:
            path = ckpt.save_checkpoint(self.ckpt_root, name, self.draft, self.optimizer, saved)
            ckpt.prune_checkpoints(self.ckpt_root, recipe.keep_checkpoints)
        if self.dist_state.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
        return path


def autocast(recipe: TrainRecipe, device: torch.device) -> AbstractContextManager[Any]:
    """bf16 autocast for the draft's matmuls on CUDA (``recipe.bf16``); nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if recipe.bf16 and device.type == "cuda" else nullcontext()


# -- the run ----------------------------------------------------------------------------------


def run_training(recipe: TrainRecipe, *, stop_at_step: int | None = None) -> dict[str, Any]:
    """Train as the recipe says; returns the summary (also written to ``output_dir/summary.json``).

    ``stop_at_step`` stops after that global step with a checkpoint, as a preemption would (tests
    use it to check that resuming reproduces an uninterrupted run exactly).
    """
    dist_state, device = setup_distributed(recipe.device)
    run = None
    try:
        run = setup(recipe, dist_state, device)
        interrupted, last_log = train(run, stop_at_step)
        final_path = run.ckpt_root / ckpt.FINAL_NAME
        if not interrupted:
            final_path = run.checkpoint(ckpt.FINAL_NAME)
        summary = _summary(run, interrupted, final_path, last_log)
        if dist_state.is_main:
            (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(summary_text(summary, run.stage.metrics.accuracy_label))
        return summary
    finally:
        graphs = run is not None and run.recipe.compile == "graph" and device.type == "cuda"
        # The DDP wrapper (its reducer holds gloo work) must be gone before the group is destroyed:
        # alive at destroy_process_group, a rank now and then aborted at exit after a finished run
        # ("terminate called without an active exception", SIGABRT: a scheduler sees a failed job).
        run = None
        if graphs:
            # The step's CUDA graphs keep their memory pool (most of the step's peak) until dynamo
            # is reset; a process that trains again (a sequential sweep's next point) would
            # otherwise carry one pool per run. The next run compiles again (inductor's cache helps).
            torch._dynamo.reset()
        if dist_state.owns_group:
            import gc

            import torch.distributed as dist

            gc.collect()  # the wrapper's hooks hold cycles: freed now, not at some later collection
            dist.destroy_process_group()


def setup(recipe: TrainRecipe, dist_state: Distributed, device: torch.device) -> TrainingRun:
    """Everything before step 1 (a resumed run: as its newest checkpoint left it)."""
    output_dir = Path(recipe.output_dir)
    if dist_state.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, output_dir / "recipe.yaml")
    torch.manual_seed(recipe.seed)

    # Store and lineage: refuse a mismatched store before anything is computed.
    store = open_training_store(recipe)
    if recipe.compile == "auto" and recipe.stage == "draft":  # the store's scored share counts (compile_modes)
        fraction = scored_token_fraction(store)
        recipe = recipe.model_copy(update={"compile": str(compile_mode_for(recipe, device, fraction))})
        logger.info("compile: auto -> %s (%s of the store's tokens scored)", recipe.compile,
                    "unknown" if fraction is None else f"{fraction:.0%}")
    stage = stage_for(recipe)
    teacher = choose_teacher(store, recipe.teacher)
    lineage = check_lineage(
        store, recipe.target, expect_aux_layer_ids=recipe.expect_aux_layer_ids,
        draft_aux_layer_ids=stage.continued_aux_layer_ids(), hash_weights=recipe.verify_weights,
        aux_layer_ids=recipe.aux_layer_ids,
    )
    logger.info("lineage ok: %s", lineage)

    # The model. What of the target is needed: embed_tokens (draft input) and lm_head (the teacher).
    heads = load_target_heads(recipe.target, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16).to(device)
    resume_from = ckpt.latest_checkpoint(output_dir / "checkpoints") if recipe.resume else None
    if resume_from is None:
        draft = stage.build_model(store, heads, output_dir, dist_state.is_main)
    else:
        draft = stage.resume_model(resume_from, device)
    draft.embed_tokens.weight.requires_grad_(False)
    draft = draft.to(device)
    check_compile_mode(compile_mode_for(recipe, device), device, dist_state.world_size, recipe.grad_accum_steps,
                       recipe.fp8)
    model = wrap_ddp(stage.build_objective(draft, teacher, heads, device), dist_state)
    params = [p for p in draft.parameters() if p.requires_grad]
    settings = recipe.optimizer
    optimizer = torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay,
        fused=device.type == "cuda",
    )
    saved = ckpt.read_state(resume_from) if resume_from is not None else None
    if resume_from is not None and saved is not None:
        ckpt.load_optimizer(optimizer, resume_from, device)
        logger.info("resuming from %s (step %d)", resume_from, saved["step"])

    # The data: the features this stage reads with this teacher, from where the checkpoint left off.
    loader_settings = LoaderSettings.from_recipe(recipe, store, dist_state, device)
    loader = open_loader(store, stage.features(teacher), loader_settings)
    logger.info(
        "reading %s (%d samples) through %s: %d reads in flight, %d batches ahead", store.url,
        loader.num_samples, store.location.range_reader, loader.read_threads, loader.prefetch_batches,
    )
    epochs = range(recipe.schedule.epochs)
    total_steps = recipe.max_steps or sum(loader.num_batches(e) for e in epochs) // recipe.grad_accum_steps
    progress = Progress.restore(saved, loader.initial_state())
    batches = WaitTimer(batch_stream(loader, loader_settings, progress.loader_state, recipe.loader.num_workers))
    return TrainingRun(
        recipe=recipe, stage=stage, dist_state=dist_state, device=device, teacher=teacher, lineage=lineage,
        draft=draft, model=model, params=params, optimizer=optimizer, loader=loader, batches=batches,
        total_steps=total_steps, progress=progress,
    )


def train(run: TrainingRun, stop_at_step: int | None = None) -> tuple[bool, dict[str, Any]]:
    """Optimizer steps until ``total_steps``, or until a signal or ``stop_at_step`` (then a
    checkpoint). Returns whether it was interrupted, and the last metrics record."""
    recipe, dist_state, progress = run.recipe, run.dist_state, run.progress
    window = MetricsWindow(run.stage.metrics)
    last_log: dict[str, Any] = {}
    bar = None
    if dist_state.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.total_steps, initial=progress.step, desc=f"train {recipe.stage}", unit="step",
                   dynamic_ncols=True)
    interrupted = False
    with Preemption() as preemption:
        while progress.step < run.total_steps:
            lr = lr_at(progress.step, run.total_steps, recipe)
            epoch = run.optimizer_step(lr, window)
            step = progress.step

            at_log = step % recipe.log_every == 0 or step == run.total_steps
            if at_log:
                last_log = run.log(window, epoch, lr, bar)
            if bar is not None:
                bar.update(1)
            if recipe.checkpoint_every and step % recipe.checkpoint_every == 0 and step < run.total_steps:
                run.checkpoint(ckpt.step_dir_name(step))
            # Several ranks agree on a signal at log steps only (one all-reduce and host sync each).
            signalled = preemption.agreed(dist_state) if (dist_state.world_size == 1 or at_log) else False
            if (stop_at_step is not None and step >= stop_at_step and step < run.total_steps) or signalled:
                if window.steps:
                    last_log = run.log(window, epoch, lr, bar)
                run.checkpoint(ckpt.step_dir_name(step))
                interrupted = True
                break
    if bar is not None:
        bar.close()
    return interrupted, last_log


def open_training_store(recipe: TrainRecipe) -> hsstore.Store:
    """The recipe's store, with a local read cache when ``loader.cache_dir`` is set."""
    cache = ReadCache(recipe.loader.cache_dir, recipe.loader.cache_max_bytes) if recipe.loader.cache_dir else None
    return hsstore.open_store(recipe.store, storage_options=recipe.storage_options or None, cache=cache)


def _summary(run: TrainingRun, interrupted: bool, final_path: Path, last_log: dict[str, Any]) -> dict[str, Any]:
    recipe, dist_state, totals = run.recipe, run.dist_state, run.progress.totals
    plan = run.loader.plan(0)
    # Tokens, padding, wait and wall time come from the log records (already summed over ranks);
    # skipped samples are counted per rank.
    skipped = int(all_reduce_(torch.tensor([float(totals["skipped"])], dtype=torch.float64), dist_state)[0])
    wall_s = max(float(totals["wall_s"]), 1e-9)
    return {
        "stage": recipe.stage,
        "model": recipe.model,
        "steps": run.progress.step,
        "total_steps": run.total_steps,
        "interrupted": interrupted,
        "world_size": dist_state.world_size,
        "compile": recipe.compile,  # the mode this run used (compile: auto resolved at setup)
        "teacher": run.teacher.value,  # what the labels were (teacher: auto resolved against the store)
        "tokens": int(totals["tokens"]),
        "tokens_per_s": totals["tokens"] / wall_s,
        "data_wait_frac": totals["wait_s"] / (wall_s * dist_state.world_size),
        "padding_frac": plan.padding_fraction,
        "rows_dropped_per_epoch": plan.num_rows_dropped,
        "samples_truncated_per_epoch": plan.num_samples_truncated,
        "samples_skipped": skipped,
        "final_loss": last_log.get("loss"),
        "final_acc": last_log.get("acc"),
        "final_kl": last_log.get("kl"),
        "checkpoint": str(final_path) if not interrupted else str(ckpt.latest_checkpoint(final_path.parent)),
        "wall_s": wall_s,
    }


# -- one stage's pieces without the loop (benchmarks/bench_train.py times the objective alone) --


def build_draft(
    recipe: TrainRecipe, store: hsstore.Store, heads: TargetHeads, output_dir: Path, is_main: bool
) -> Eagle3Draft:
    """The recipe's stage's model at step 0."""
    return stage_for(recipe).build_model(store, heads, output_dir, is_main)


def build_objective(
    recipe: TrainRecipe, draft: Eagle3Draft, teacher_mode: TeacherMode, heads: TargetHeads, device: torch.device
) -> nn.Module:
    """The recipe's stage's objective around ``draft``."""
    return stage_for(recipe).build_objective(draft, teacher_mode, heads, device)
