"""The target's sampling distribution and lossless verification of a draft tree by sampling.

The tree is a deterministic function of the prefix (EAGLE-2 top-k selection), so each sibling
is a proposal whose draft distribution is a point mass. Multi-draft recursive rejection sampling
(SpecInfer; EAGLE's and SGLang's ``tree_speculative_sampling_target_only``) then reads: at a
node with target distribution ``p``, try the children best first; accept child ``y`` with
probability ``p(y)``; on rejection the residual is ``norm(max(p - onehot(y), 0))``, i.e. ``p``
with ``y`` zeroed and renormalised; if every child is rejected, the bonus token is drawn from
the last residual. Summed over the branches, each token ``z`` comes out with probability exactly
``p(z)``, so the emitted sequence has the target's distribution whatever the draft proposes.
"""

from __future__ import annotations

import torch

from pipelines.evaluate.tree import DraftTree


def warp_logits(logits_NV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Target sampling probabilities after temperature and top-p, as transformers' warpers do.

    Mirrors ``TemperatureLogitsWarper`` then ``TopPLogitsWarper`` (tokens whose ascending
    cumulative probability is ``<= 1 - top_p`` are removed, the most likely one always kept),
    so the speculative output distribution equals ``generate(do_sample=True, ...)``'s.
    """
    if temperature <= 0:
        raise ValueError("warp_logits needs temperature > 0; temperature 0 is greedy decoding")
    scores = logits_NV.float() / temperature
    if top_p < 1.0:
        sorted_scores, sorted_index = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def rejection_step(
    probs_V: torch.Tensor, candidates: list[int], generator: torch.Generator
) -> tuple[int | None, int | None]:
    """Verify one node's children (target ids, best first) against target probabilities.

    Returns ``(i, None)`` when candidate ``i`` is accepted, or ``(None, token)`` with the bonus
    token drawn from the residual when all are rejected. ``probs_V`` lives on the CPU (float64
    keeps the renormalisations exact enough for the statistical tests).
    """
    residual = probs_V.to(torch.float64).clone()
    for i, token in enumerate(candidates):
        mass = float(residual[token])
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < mass:
            return i, None
        residual[token] = 0.0
        total = float(residual.sum())
        # A rejected token cannot have held all the mass: rand() < 1.0 always accepts it.
        assert total > 0.0, "rejection left an empty residual"
        residual /= total
    bonus = int(torch.multinomial(residual, 1, generator=generator))
    return None, bonus


def sampling_walk(
    tree: DraftTree,
    node_probs: NodeProbs,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Walk the tree by recursive rejection sampling; returns accepted nodes and the bonus.

    ``node_probs(s)`` gives the target's sampling distribution after sequence index ``s``
    (0 = root) on the CPU; only the visited nodes' rows are ever materialised there.
    """
    children = tree.children()
    accepted: list[int] = []
    seq_index = 0
    while True:
        kids = children[seq_index]
        probs_V = node_probs(seq_index)
        if not kids:
            return accepted, int(torch.multinomial(probs_V.double(), 1, generator=generator))
        choice, bonus = rejection_step(probs_V, [tree.tokens[c] for c in kids], generator)
        if choice is None:
            assert bonus is not None
            return accepted, bonus
        accepted.append(kids[choice])
        seq_index = kids[choice] + 1


class NodeProbs:
    """Lazily warped target distributions of a verified tree, one CPU row per visited node."""

    def __init__(self, logits_SV: torch.Tensor, temperature: float, top_p: float) -> None:
        self.logits_SV = logits_SV
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, seq_index: int) -> torch.Tensor:
        row = warp_logits(self.logits_SV[seq_index], self.temperature, self.top_p)
        return row.cpu()
