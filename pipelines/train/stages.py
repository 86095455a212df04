"""What a run trains: each stage is a plugin the training loop drives without knowing which it is.

A stage declares the store features it reads for each teacher mode, builds (or resumes) its model,
builds the objective one step computes and turns that objective's per-depth sums into the loss; its
:class:`~pipelines.train.metrics.StageMetrics` say what its logs call their numbers. The loop in
:mod:`pipelines.train.trainer` is the same for every stage. ``TrainRecipe.stage`` picks one from
:data:`STAGES`.

- :class:`DraftStage` (``stage: draft``): an EAGLE-3 or EAGLE-4 draft (the family is the draft
  config's business: EAGLE-4 is the same layer with a sliding window), fitted by the TTT unroll's
  soft cross-entropy against the target's distribution, which the teacher features carry.
- :class:`CandidateHeadStage` (``stage: candidate_head``, EAGLE-4 stage 2): a low-rank head on a
  frozen stage-1 draft, fitted by KL to that draft's own lm_head; it reads no teacher feature.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import pyarrow.compute as pc
import torch
from torch import nn

import hsstore
from hsstore.aux_layers import AUX_HIDDEN_STATES, select_aux_layers
from pipelines.models.checkpoint import (
    init_from_pretrained,
    load_draft,
    read_draft_config,
    resolve_draft_dir,
)
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.train.candidate import attach_candidate_head
from pipelines.train.compile_modes import CompileMode, resolve_compile_mode
from pipelines.train.config import TrainRecipe
from pipelines.train.metrics import CANDIDATE_HEAD_METRICS, DRAFT_METRICS, StageMetrics
from pipelines.train.objective import (
    CandidateObjective,
    DraftObjective,
    ObjectiveOutput,
    objective_loss,
)
from pipelines.train.target_heads import TargetHeads
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


class TrainingStage(ABC):
    """One kind of training run, configured by the recipe it was built from."""

    name: ClassVar[str]
    metrics: ClassVar[StageMetrics]
    # Divide the depth-weighted loss by the weights' sum (so its scale does not grow with the unroll).
    normalise_depth_weights: ClassVar[bool]

    def __init__(self, recipe: TrainRecipe) -> None:
        self.recipe = recipe

    @abstractmethod
    def features(self, teacher: TeacherMode) -> list[str]:
        """The store features one batch needs when the store's distribution is ``teacher``."""

    @abstractmethod
    def continued_draft(self) -> str | None:
        """A trained draft this run continues from (its aux layers must be the ones trained on)."""

    @abstractmethod
    def build_model(self, store: hsstore.Store, heads: TargetHeads, output_dir: Path, is_main: bool) -> Eagle3Draft:
        """The model at step 0 (``is_main``: this rank writes shared files such as the vocabulary)."""

    @abstractmethod
    def build_objective(
        self, draft: Eagle3Draft, teacher: TeacherMode, heads: TargetHeads, device: torch.device
    ) -> nn.Module:
        """What one micro-batch computes: an ``nn.Module`` returning an :class:`ObjectiveOutput`."""

    def resume_model(self, checkpoint: Path, device: torch.device) -> Eagle3Draft:
        """The model as a checkpoint of this stage saved it."""
        return load_draft(checkpoint, device=device)

    def continued_aux_layer_ids(self) -> list[int] | None:
        """Aux layers of the continued draft, for the lineage check (None: nothing continued)."""
        path = self.continued_draft()
        if path is None or not Path(path).is_dir():
            return None
        return list(read_draft_config(resolve_draft_dir(path)).aux_layer_ids)

    def loss(self, out: ObjectiveOutput, denominators: torch.Tensor, world_size: int) -> torch.Tensor:
        """The micro-batch's loss from the objective's per-depth sums and their global denominators."""
        return objective_loss(out, denominators, self.recipe.loss_decay, self.normalise_depth_weights, world_size)


class DraftStage(TrainingStage):
    """Stage 1: a fresh EAGLE-3/EAGLE-4 draft (vocabulary calibrated, the target's embeddings
    copied, optionally ``init_from`` a pretrained draft), trained against the target's distribution."""

    name = "draft"
    metrics = DRAFT_METRICS
    normalise_depth_weights = False

    def features(self, teacher: TeacherMode) -> list[str]:
        return [AUX_HIDDEN_STATES, *teacher.features]

    def continued_draft(self) -> str | None:
        return self.recipe.init_from

    def build_model(self, store: hsstore.Store, heads: TargetHeads, output_dir: Path, is_main: bool) -> Eagle3Draft:
        from transformers import AutoConfig

        recipe = self.recipe
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

    def build_objective(
        self, draft: Eagle3Draft, teacher: TeacherMode, heads: TargetHeads, device: torch.device
    ) -> DraftObjective:
        # The final state's teacher needs the target's lm_head; the compact ones carry their logits.
        head = TeacherHead(heads.lm_head_VH, draft.d2t, draft.t2d) if teacher == TeacherMode.FINAL_HIDDEN else None
        recipe = self.recipe
        return DraftObjective(
            draft, teacher, head, recipe.ttt_length, recipe.attention,
            compile=compile_mode_for(recipe, device), fp8=recipe.fp8,
        )


class CandidateHeadStage(TrainingStage):
    """Stage 2 (EAGLE-4): the stage-1 draft frozen, a rank-r candidate head initialised from its
    lm_head's SVD; only the head trains. Its teacher is the draft's own head, so the store's
    teacher features are not read."""

    name = "candidate_head"
    metrics = CANDIDATE_HEAD_METRICS
    normalise_depth_weights = True

    def features(self, teacher: TeacherMode) -> list[str]:
        return [AUX_HIDDEN_STATES]

    def continued_draft(self) -> str | None:
        return self.recipe.candidate_head.draft_checkpoint

    def build_model(self, store: hsstore.Store, heads: TargetHeads, output_dir: Path, is_main: bool) -> Eagle3Draft:
        settings = self.recipe.candidate_head
        assert settings.draft_checkpoint is not None  # TrainRecipe requires it for this stage
        draft = load_draft(settings.draft_checkpoint, embed_tokens=heads.embed_tokens_VH.float())
        attach_candidate_head(draft, settings.rank, settings.num_candidates)
        return draft

    def resume_model(self, checkpoint: Path, device: torch.device) -> Eagle3Draft:
        # The head's config (rank, K) came back with the checkpoint; only the head trains.
        draft = super().resume_model(checkpoint, device)
        for param in draft.parameters():
            param.requires_grad_(False)
        assert draft.candidate_head is not None
        for param in draft.candidate_head.parameters():
            param.requires_grad_(True)
        return draft

    def build_objective(
        self, draft: Eagle3Draft, teacher: TeacherMode, heads: TargetHeads, device: torch.device
    ) -> CandidateObjective:
        assert draft.config.num_candidates is not None  # attach_candidate_head recorded it
        return CandidateObjective(draft, self.recipe.ttt_length, draft.config.num_candidates, self.recipe.attention)


STAGES: dict[str, type[TrainingStage]] = {stage.name: stage for stage in (DraftStage, CandidateHeadStage)}


def stage_for(recipe: TrainRecipe) -> TrainingStage:
    """The plugin for ``recipe.stage``."""
    return STAGES[recipe.stage](recipe)


def draft_vocabulary(recipe: TrainRecipe, store: hsstore.Store, vocab_size: int) -> DraftVocab:
    """Calibrated from the store's loss-masked token counts, read from a file, or the full vocab."""
    vocab = recipe.draft.vocab
    if vocab.full:
        return DraftVocab.full(vocab_size)
    if vocab.vocab_file is not None:
        return read_vocab_file(vocab.vocab_file, vocab_size)
    assert vocab.draft_vocab_size is not None  # VocabConfig requires exactly one source
    counts = count_loss_tokens_in_table(store.samples, vocab_size)
    return calibrate_vocab(counts, min(vocab.draft_vocab_size, vocab_size))


def training_aux_layer_ids(recipe: TrainRecipe, store: hsstore.Store) -> list[int]:
    """The aux layer ids this run trains on: the recipe's subset of the store's captured layers."""
    captured = list(store.lineage.aux_layer_ids)
    return [captured[i] for i in select_aux_layers(captured, recipe.aux_layer_ids)]


def compile_mode_for(recipe: TrainRecipe, device: torch.device, scored_fraction: float | None = None) -> CompileMode:
    """The recipe's ``compile`` resolved for this run (``auto`` depends on the device, the number
    of processes, gradient accumulation, ``fp8`` and the store's ``scored_fraction``:
    ``pipelines.train.compile_modes``)."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return resolve_compile_mode(recipe.compile, device, world_size, recipe.grad_accum_steps, scored_fraction, recipe.fp8)


def scored_token_fraction(store: hsstore.Store, max_shards: int = 8) -> float | None:
    """The share of the store's tokens its loss mask scores, from up to ``max_shards`` shards
    spread over the manifest (each a small Arrow table: a large remote store is not read whole
    for this). None for an empty store."""
    shards = store.shards
    if not shards:
        return None
    step = max(1, len(shards) // max_shards)
    tokens = scored = 0
    for shard in shards[::step][:max_shards]:
        table = store.shard_samples(shard.shard_id)
        tokens += pc.sum(table.column("num_tokens")).as_py() or 0
        scored += pc.sum(table.column("num_loss_tokens")).as_py() or 0
    return scored / tokens if tokens else None
