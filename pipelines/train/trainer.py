"""The training loop: stream packed batches from the store, fit the draft, checkpoint, resume.

Reads top to bottom like nanoGPT's train.py: setup (distributed, store, lineage, target heads,
draft, objective, optimizer, loader), then one loop that does, per optimizer step and for each of
``grad_accum_steps`` micro-batches: wait for a batch (timed: the data-wait fraction), move it to
the device, run the objective (``pipelines.train.objective``: teacher + TTT unroll + loss, or the
candidate head's KL for stage 2) and backpropagate; then clip, step AdamW with warmup+cosine,
log, checkpoint.

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
import signal
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

import hsstore
from hsstore.aux_layers import select_aux_layers
from hsstore.loader import LoaderState, StreamingLoader
from hsstore.read_cache import ReadCache
from hsstore.torch_data import WaitTimer, to_device
from pipelines.models.checkpoint import (
    init_from_pretrained,
    load_draft,
    read_draft_config,
    resolve_draft_dir,
)
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.recipe import dump_recipe
from pipelines.train import checkpoint as ckpt
from pipelines.train.candidate import attach_candidate_head
from pipelines.train.config import TrainRecipe
from pipelines.train.distributed import (
    Distributed,
    all_reduce_,
    no_sync_unless,
    setup_distributed,
    wrap_ddp,
)
from pipelines.train.lineage_check import check_lineage, choose_teacher
from pipelines.train.metrics import MetricsWindow, append_record, summary_text
from pipelines.train.objective import (
    AUX,
    CandidateObjective,
    DraftObjective,
    loss_denominators,
    objective_loss,
)
from pipelines.train.target_heads import TargetHeads, load_target_heads
from pipelines.train.teacher import TeacherHead
from pipelines.train.teacher_mode import TeacherMode
from pipelines.train.vocab import (
    DraftVocab,
    calibrate_vocab,
    count_loss_tokens_in_table,
    read_vocab_file,
    write_vocab_file,
)

logger = logging.getLogger(__name__)


# -- setup helpers ---------------------------------------------------------------------------


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
        aux_layer_ids=training_aux_layer_ids(recipe, store),
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


# -- setup -----------------------------------------------------------------------------------


def resume_or_build_draft(
    recipe: TrainRecipe, store: hsstore.Store, heads: TargetHeads, output_dir: Path, resume_from: Path | None,
    dist_state: Distributed, device: torch.device,
) -> Eagle3Draft:
    """The checkpoint's draft when resuming (stage 2: only its candidate head trains), else a new one."""
    if resume_from is None:
        draft = build_draft(recipe, store, heads, output_dir, dist_state.is_main)
    else:
        draft = load_draft(resume_from, device=device)
        if recipe.stage == "candidate_head":
            # The head's config (rank, K) came back with the checkpoint; only the head trains.
            for param in draft.parameters():
                param.requires_grad_(False)
            assert draft.candidate_head is not None
            for param in draft.candidate_head.parameters():
                param.requires_grad_(True)
    draft.embed_tokens.weight.requires_grad_(False)
    return draft.to(device)


def use_compile(recipe: TrainRecipe, device: torch.device) -> bool:
    """``compile: auto`` compiles on CUDA only: the CPU CI has no compiler toolchain to rely on."""
    return recipe.compile == "on" or (recipe.compile == "auto" and device.type == "cuda")


def build_objective(
    recipe: TrainRecipe, draft: Eagle3Draft, teacher_mode: TeacherMode, heads: TargetHeads, device: torch.device
) -> DraftObjective | CandidateObjective:
    if recipe.stage == "candidate_head":
        assert draft.config.num_candidates is not None
        return CandidateObjective(draft, recipe.ttt_length, draft.config.num_candidates, recipe.attention)
    head = TeacherHead(heads.lm_head_VH, draft.d2t, draft.t2d) if teacher_mode == TeacherMode.FINAL_HIDDEN else None
    return DraftObjective(
        draft, teacher_mode, head, recipe.ttt_length, recipe.attention, compile=use_compile(recipe, device)
    )


def training_aux_layer_ids(recipe: TrainRecipe, store: hsstore.Store) -> list[int]:
    """The aux layer ids this run trains on: the recipe's subset of the store's captured layers."""
    captured = list(store.lineage.aux_layer_ids)
    return [captured[i] for i in select_aux_layers(captured, recipe.aux_layer_ids)]


def loader_arguments(recipe: TrainRecipe, dist_state: Distributed, device: torch.device) -> dict[str, Any]:
    """The loader's keyword arguments, shared by the in-process loader and DataLoader workers."""
    settings = recipe.loader
    return dict(
        token_budget=settings.token_budget, rows_per_batch=settings.rows_per_batch, seed=recipe.seed,
        shuffle_window=settings.shuffle_window, rank=dist_state.rank, world_size=dist_state.world_size,
        remainder=settings.remainder, long_samples=settings.long_samples, read_threads=settings.read_threads,
        prefetch_batches=settings.prefetch_batches, skip_corrupt=recipe.skip_corrupt,
        # Training on the CPU: fp8 features are decoded by the read threads, overlapping the step;
        # a GPU decodes them for free and the host moves half the bytes.
        decode_on_host=device.type == "cpu",
    )


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

    def agreed(self, dist_state: Distributed) -> bool:
        """Whether any rank was signalled (an all-reduce: called at log steps only on several ranks)."""
        if dist_state.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=dist_state.device)
        return bool(all_reduce_(flag, dist_state).item())


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
    cache = ReadCache(recipe.loader.cache_dir, recipe.loader.cache_max_bytes) if recipe.loader.cache_dir else None
    store = hsstore.open_store(recipe.store, storage_options=recipe.storage_options or None, cache=cache)
    teacher_mode = choose_teacher(store, recipe.teacher)
    lineage = check_lineage(
        store, recipe.target, expect_aux_layer_ids=recipe.expect_aux_layer_ids,
        draft_aux_layer_ids=continued_draft_aux_ids(recipe), hash_weights=recipe.verify_weights,
        aux_layer_ids=recipe.aux_layer_ids,
    )
    logger.info("lineage ok: %s", lineage)

    # What of the target is needed: embed_tokens (draft input) and lm_head (the teacher).
    heads = load_target_heads(recipe.target, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16).to(device)
    resume_from = ckpt.latest_checkpoint(ckpt_root) if recipe.resume else None
    draft = resume_or_build_draft(recipe, store, heads, output_dir, resume_from, dist_state, device)
    objective = build_objective(recipe, draft, teacher_mode, heads, device)
    model = wrap_ddp(objective, dist_state)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=recipe.optimizer.lr, betas=recipe.optimizer.betas, eps=recipe.optimizer.eps,
        weight_decay=recipe.optimizer.weight_decay, fused=device.type == "cuda",
    )
    state = ckpt.read_state(resume_from) if resume_from is not None else None
    if resume_from is not None and state is not None:
        ckpt.load_optimizer(optimizer, resume_from, device)
        logger.info("resuming from %s (step %d)", resume_from, state["step"])

    # The loader: teacher features only for stage 1 (stage 2's teacher is the draft's own head).
    features = [AUX] + (list(teacher_mode.features) if recipe.stage == "draft" else [])
    loader_kwargs = loader_arguments(recipe, dist_state, device)
    # Only the chosen aux layers are read (a store written with layer_arrays reads only their bytes).
    loader_kwargs["layers"] = {AUX: select_aux_layers(store.lineage.aux_layer_ids, recipe.aux_layer_ids)}
    loader = StreamingLoader(store, features, **loader_kwargs)
    logger.info(
        "reading %s (%d samples) through %s: %d reads in flight, %d batches ahead", store.url,
        loader.num_samples, store.location.range_reader, loader.read_threads, loader.prefetch_batches,
    )
    accum = recipe.grad_accum_steps
    total_steps = recipe.max_steps or sum(loader.num_batches(e) for e in range(recipe.schedule.epochs)) // accum
    step = 0
    loader_state = loader.initial_state()
    totals = {"tokens": 0, "padding": 0, "wait_s": 0.0, "wall_s": 0.0, "skipped": 0}
    if state is not None:
        step = int(state["step"])
        loader_state = LoaderState.from_dict(state["loader"])
        totals.update({k: v for k, v in state.get("totals", {}).items() if k in totals})
    if recipe.loader.num_workers > 0:
        from hsstore.torch_data import make_dataloader

        batches = iter(make_dataloader(store, features, loader_state, num_workers=recipe.loader.num_workers,
                                       **loader_kwargs))
    else:
        batches = loader.batches(loader_state)
    timer = WaitTimer(batches)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if recipe.bf16 and device.type == "cuda" else nullcontext()
    metrics_path = output_dir / "metrics.jsonl"
    window = MetricsWindow(recipe.stage)
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

    def log(epoch: int, lr: float) -> dict[str, Any]:
        record = window.reduce(step, lr, epoch, dist_state)
        for key, value in window.reduced_totals.items():
            totals[key] += value
        if dist_state.is_main:
            append_record(record, metrics_path)
            if progress is not None:
                progress.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.3f}")
        return record

    interrupted = False
    with _Preemption() as preemption:
        while step < total_steps:
            lr = lr_at(step, total_steps, recipe)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro in range(accum):
                host = next(timer)
                batch = to_device(host, loader.specs, device, pin_memory=device.type == "cuda")
                if device.type == "cpu":  # CPU bf16 matmuls are slow; features go in as float32
                    batch.features = {k: v.float() if v.is_floating_point() else v for k, v in batch.features.items()}
                with no_sync_unless(micro == accum - 1, model):
                    with autocast:
                        out = model(batch.features, batch.input_ids, batch.position_ids, batch.loss_mask, batch.doc_ids)
                    counts = all_reduce_(torch.stack(out.counts).to(torch.float64), dist_state)
                    denominators = loss_denominators(recipe.loss_normalization, counts, batch.num_real_tokens, dist_state)
                    loss = objective_loss(out, denominators, recipe.loss_decay, recipe.stage != "draft", dist_state.world_size)
                    (loss / accum).backward()
                window.add_micro_batch(loss / dist_state.world_size, out, batch.num_real_tokens,
                                       batch.num_padding_tokens, timer.last_wait)
                totals["skipped"] += batch.num_skipped_samples
                loader_state = loader.state_after(host)
                host.release()  # the loader may refill its buffers (a GPU copy released them already)
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(params, recipe.optimizer.grad_clip)
                if recipe.optimizer.grad_clip is not None
                else torch.zeros((), device=device)
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window.end_step(grad_norm)

            at_log = step % recipe.log_every == 0 or step == total_steps
            if at_log:
                last_log = log(host.epoch, lr)
            if progress is not None:
                progress.update(1)
            if recipe.checkpoint_every and step % recipe.checkpoint_every == 0 and step < total_steps:
                checkpoint(ckpt.step_dir_name(step))
            # Several ranks agree on a signal at log steps only (one all-reduce and host sync each).
            signalled = preemption.agreed(dist_state) if (dist_state.world_size == 1 or at_log) else False
            if (stop_at_step is not None and step >= stop_at_step and step < total_steps) or signalled:
                if window.steps:
                    last_log = log(host.epoch, lr)
                checkpoint(ckpt.step_dir_name(step))
                interrupted = True
                break
    if progress is not None:
        progress.close()
    final_path = ckpt_root / ckpt.FINAL_NAME
    if not interrupted:
        final_path = checkpoint(ckpt.FINAL_NAME)
    summary = _summary(recipe, step, total_steps, totals, last_log, loader, dist_state, interrupted, final_path)
    if dist_state.is_main:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(summary_text(summary))
    return summary


def _summary(recipe: TrainRecipe, step: int, total_steps: int, totals: dict[str, Any], last_log: dict[str, Any],
             loader: StreamingLoader, dist_state: Distributed, interrupted: bool, final_path: Path) -> dict[str, Any]:
    plan = loader.plan(0)
    # Tokens, padding, wait and wall time come from the log records (already summed over ranks);
    # skipped samples are counted per rank.
    skipped = int(all_reduce_(torch.tensor([float(totals["skipped"])], dtype=torch.float64), dist_state)[0])
    wall_s = max(float(totals["wall_s"]), 1e-9)
    return {
        "stage": recipe.stage,
        "model": recipe.model,
        "steps": step,
        "total_steps": total_steps,
        "interrupted": interrupted,
        "world_size": dist_state.world_size,
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
