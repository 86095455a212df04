"""Speculative decoding of one prompt (batch size 1), and the target-only baseline it is timed against.

One iteration: the draft proposes a tree below the root (the last committed token), the target
verifies root + tree in ONE forward, the walk picks the accepted path plus one bonus token from
the target, the target cache keeps the root and the accepted nodes, and the draft's step-0
cache is extended with the newly committed positions. Tokens per verification forward (accepted
draft tokens + the bonus) is the acceptance length. The prefill forward, which emits the first
token on its own, is not a verification and is not counted in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipelines.evaluate.sampling import NodeProbs, sampling_walk, warp_logits
from pipelines.evaluate.target import TargetModel, synchronize
from pipelines.evaluate.tree import DraftTree, greedy_walk, tree_attention_mask, tree_position_ids


class Proposer(Protocol):
    """What the decoding loop needs of a draft (:class:`~pipelines.evaluate.drafter.TreeDrafter`).

    ``extend`` receives, for each newly committed position t, the target's aux states of t and
    the token t+1; ``propose`` drafts a tree below the last of those tokens (the root).
    """

    seconds: float
    num_forwards: int

    def reset(self) -> None: ...

    def extend(self, aux_QKH: torch.Tensor, next_tokens_Q: torch.Tensor) -> None: ...

    def propose(self, top_k: int, depth: int, total_draft_tokens: int) -> DraftTree: ...


@dataclass(frozen=True)
class TreeShape:
    """How much to draft per step: a chain is ``top_k=1, total_draft_tokens=depth``."""

    top_k: int
    depth: int
    total_draft_tokens: int


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; otherwise the target's tempered, top-p truncated distribution."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationResult:
    """One prompt's output and the counts the metrics are built from."""

    output_ids: list[int]
    wall_seconds: float
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    num_target_forwards: int = 0  # verification forwards (prefill excluded)
    num_draft_forwards: int = 0
    tokens_per_step: list[int] = field(default_factory=list)  # accepted + 1, per verification
    depth_attempts: list[int] = field(default_factory=list)  # [d-1]: steps that reached depth d
    depth_accepts: list[int] = field(default_factory=list)  # [d-1]: steps that accepted depth d
    num_tree_nodes: int = 0  # draft tokens verified, summed over steps


def eos_token_ids(model: torch.nn.Module) -> set[int]:
    """The stop tokens ``generate`` would use (generation_config, else the model config)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Cut at the first stop token (kept) and at max_new_tokens, as ``generate`` does."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _pick(logits_V: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    if sampling.greedy:
        return int(logits_V.argmax())
    probs = warp_logits(logits_V, sampling.temperature, sampling.top_p).cpu().double()
    return int(torch.multinomial(probs, 1, generator=generator))


def _record_depths(result: GenerationResult, tree_depth: int, num_accepted: int) -> None:
    while len(result.depth_attempts) < tree_depth:
        result.depth_attempts.append(0)
        result.depth_accepts.append(0)
    for d in range(1, tree_depth + 1):
        if num_accepted >= d - 1:
            result.depth_attempts[d - 1] += 1
        if num_accepted >= d:
            result.depth_accepts[d - 1] += 1


@dataclass(frozen=True)
class _Measurement:
    """The clock and the forward counters at the start of one prompt's generation.

    The target and the drafter keep cumulative counters across prompts (their ``reset`` clears the
    caches, not the counts), so a result reports the difference between its end and this start.
    Both generators are measured the same way, which is what makes their wall times comparable.
    """

    target: TargetModel
    drafter: Proposer | None
    started: float
    target_seconds0: float
    target_forwards0: int
    draft_seconds0: float
    draft_forwards0: int

    @classmethod
    def begin(cls, target: TargetModel, drafter: Proposer | None = None) -> _Measurement:
        """Start timing once the device is idle, then reset the caches (inside the timed span)."""
        synchronize(target.device)
        started = time.perf_counter()
        measurement = cls(
            target=target,
            drafter=drafter,
            started=started,
            target_seconds0=target.forward_seconds,
            target_forwards0=target.num_forwards,
            draft_seconds0=drafter.seconds if drafter is not None else 0.0,
            draft_forwards0=drafter.num_forwards if drafter is not None else 0,
        )
        target.reset()
        if drafter is not None:
            drafter.reset()
        return measurement

    def end(
        self, result: GenerationResult, generated: list[int], max_new_tokens: int, eos_ids: set[int]
    ) -> GenerationResult:
        """Wait for the device, cut the output as ``generate`` would, and fill in the times and counts."""
        synchronize(self.target.device)
        result.output_ids = _finish(generated, max_new_tokens, eos_ids)
        result.wall_seconds = time.perf_counter() - self.started
        result.target_seconds = self.target.forward_seconds - self.target_seconds0
        # The prefill forward emits the first token on its own: it is not a verification.
        result.num_target_forwards = self.target.num_forwards - self.target_forwards0 - 1
        if self.drafter is not None:
            result.draft_seconds = self.drafter.seconds - self.draft_seconds0
            result.num_draft_forwards = self.drafter.num_forwards - self.draft_forwards0
        return result


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: Proposer,
    prompt_ids: list[int],
    shape: TreeShape,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: set[int],
    generator: torch.Generator,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` with draft-and-verify steps."""
    measurement = _Measurement.begin(target, drafter)
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    prefill = target.forward(prompt, last_logits_only=True)
    root = _pick(prefill.logits_QV[-1], sampling, generator)
    generated = [root]
    result = GenerationResult(output_ids=[], wall_seconds=0.0)
    if root not in eos_ids and max_new_tokens > 1:
        drafter.extend(prefill.aux_QKH, torch.cat([prompt[1:], torch.tensor([root])]))
    while root not in eos_ids and len(generated) < max_new_tokens:
        tree = drafter.propose(shape.top_k, shape.depth, shape.total_draft_tokens)
        root_position = target.seq_length
        verify = target.forward(
            torch.tensor([root] + tree.tokens),
            tree_position_ids(tree, root_position),
            tree_attention_mask(tree),
        )
        if sampling.greedy:
            accepted, bonus = greedy_walk(tree, verify.logits_QV.argmax(-1).tolist())
        else:
            node_probs = NodeProbs(verify.logits_QV, sampling.temperature, sampling.top_p)
            accepted, bonus = sampling_walk(tree, node_probs, generator)
        kept = torch.tensor([0] + [node + 1 for node in accepted])
        target.keep(root_position, kept)
        new_tokens = [tree.tokens[node] for node in accepted] + [bonus]
        generated.extend(new_tokens)
        result.tokens_per_step.append(len(new_tokens))
        result.num_tree_nodes += len(tree)
        _record_depths(result, tree.max_depth, len(accepted))
        if any(t in eos_ids for t in new_tokens) or len(generated) >= max_new_tokens:
            break
        drafter.extend(verify.aux_QKH[kept.to(verify.aux_QKH.device)], torch.tensor(new_tokens))
        root = bonus
    return measurement.end(result, generated, max_new_tokens, eos_ids)


@torch.no_grad()
def target_only_generate(
    target: TargetModel,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: set[int],
    generator: torch.Generator,
) -> GenerationResult:
    """The baseline: the same target wrapper, one token per forward (what speedup divides by)."""
    measurement = _Measurement.begin(target)
    out = target.forward(torch.tensor(prompt_ids, dtype=torch.long), last_logits_only=True)
    generated = [_pick(out.logits_QV[-1], sampling, generator)]
    while generated[-1] not in eos_ids and len(generated) < max_new_tokens:
        out = target.forward(torch.tensor([generated[-1]]))
        generated.append(_pick(out.logits_QV[-1], sampling, generator))
    result = GenerationResult(output_ids=[], wall_seconds=0.0)
    return measurement.end(result, generated, max_new_tokens, eos_ids)
