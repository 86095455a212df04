"""Test helpers: proposers that drive the decoding loop without a trained draft, and statistics.

The proposers implement :class:`pipelines.evaluate.decoding.Proposer`. They exist because a
random draft is (correctly) almost never accepted, which would leave the accepted-path code
(cache gather, multi-token steps, deep walks) untested until a trained draft exists.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pipelines.evaluate.target import TargetModel
from pipelines.evaluate.tree import DraftTree
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def random_draft(target: TargetModel, seed: int = 0, **overrides: object) -> Eagle3Draft:
    """An untrained draft shaped for ``target``, sharing its embeddings (as training does)."""
    torch.manual_seed(seed)
    overrides = {"aux_layer_ids": target.aux_layer_ids, **overrides}
    config = Eagle3Config.from_target_config(target.model.config, **overrides)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.input_embeddings())
    return draft.to(target.dtype)


class RandomTreeProposer:
    """Random trees of random shape; with ``truth`` it plants the true continuation in them.

    ``truth`` is the full token sequence (prompt + target greedy output): the proposal then
    holds the real next tokens down to a random depth, hidden among random siblings, so greedy
    verification accepts long paths at varying depths and sibling ranks.
    """

    def __init__(self, vocab_size: int, seed: int, truth: list[int] | None = None) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.truth = truth
        self.num_positions = 0
        self.seconds = 0.0
        self.num_forwards = 0

    def reset(self) -> None:
        self.num_positions = 0

    def extend(self, aux_QKH: torch.Tensor, next_tokens_Q: torch.Tensor) -> None:
        self.num_positions += int(next_tokens_Q.shape[0])

    def _other_token(self, avoid: set[int]) -> int:
        while True:
            token = self.rng.randrange(self.vocab_size)
            if token not in avoid:
                return token

    def propose(self, top_k: int, depth: int, total_draft_tokens: int) -> DraftTree:
        tree = DraftTree()
        children_tokens: dict[int, set[int]] = {-1: set()}
        # The true path first (root = truth[num_positions], its child = the next token).
        true_depth = self.rng.randint(0, depth) if self.truth is not None else 0
        parent = -1
        for d in range(1, true_depth + 1):
            index = self.num_positions + d
            if self.truth is None or index >= len(self.truth):
                break
            token = self.truth[index]
            node = tree.add(token, parent, -float(d))
            children_tokens[parent].add(token)
            children_tokens[node] = set()
            parent = node
        # Random extra nodes with random parents (depth-limited), shuffled sibling scores.
        for _ in range(100 * total_draft_tokens):
            if len(tree) >= total_draft_tokens:
                break
            parent = self.rng.choice([-1, *range(len(tree))])
            if parent >= 0 and tree.depths[parent] >= depth:
                continue
            if len(children_tokens[parent]) >= min(top_k, self.vocab_size):
                continue
            token = self._other_token(children_tokens[parent])
            score = (tree.scores[parent] if parent >= 0 else 0.0) - self.rng.uniform(0.01, 3.0)
            node = tree.add(token, parent, score)
            children_tokens[parent].add(token)
            children_tokens[node] = set()
        return tree


def chi_square_pvalue(
    observed: list[int], expected_probs: list[float], min_expected: float = 5.0
) -> float:
    """Pearson goodness-of-fit p-value; cells expected below ``min_expected`` are pooled.

    Uses the regularised upper incomplete gamma function from torch (scipy is not a project
    dependency): P(chi2_k > x) = Q(k/2, x/2).
    """
    total = sum(observed)
    if any(obs > 0 and prob <= 0.0 for obs, prob in zip(observed, expected_probs, strict=True)):
        return 0.0  # an outcome the target cannot produce was produced
    cells: list[tuple[float, float]] = []
    pooled_obs, pooled_exp = 0.0, 0.0
    for obs, prob in zip(observed, expected_probs, strict=True):
        expected = prob * total
        if expected < min_expected:
            pooled_obs += obs
            pooled_exp += expected
        else:
            cells.append((float(obs), expected))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64),
            torch.tensor(statistic / 2, dtype=torch.float64),
        )
    )
