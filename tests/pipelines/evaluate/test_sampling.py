"""Speculative sampling is lossless: what it emits is distributed as the target's sampling.

Statistical tests use Pearson's chi-square with cells of expected count < 5 pooled, and reject
at p < 1e-3: each test has a false-alarm rate of 0.1% over random seeds (the seeds are fixed, so
a run is deterministic). Three such tests in this module: at most 0.3% by the union bound.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from pipelines.evaluate.decoding import SamplingConfig, TreeShape, speculative_generate
from pipelines.evaluate.drafter import TreeDrafter
from pipelines.evaluate.sampling import rejection_step, sampling_walk, warp_logits
from pipelines.evaluate.target import TargetModel
from pipelines.evaluate.tree import DraftTree
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from tests.pipelines.evaluate.helpers import chi_square_pvalue
from tests.support.models import tiny_qwen3

ALPHA = 1e-3


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.5, 0.01)]
)
def test_warp_logits_matches_transformers_warpers(temperature: float, top_p: float) -> None:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(warp_logits(logits, temperature, top_p), scores.softmax(-1))


class FixedNodeProbs:
    """Target distributions per tree sequence index, fixed in advance (no model)."""

    def __init__(self, probs_SV: torch.Tensor) -> None:
        self.probs_SV = probs_SV

    def __call__(self, seq_index: int) -> torch.Tensor:
        return self.probs_SV[seq_index]


def synthetic_tree() -> DraftTree:
    """root -> {2, 0, 5}; 2 -> {1, 3}; 1 -> {4}; vocab 6."""
    tree = DraftTree()
    a = tree.add(2, -1, -0.1)
    tree.add(0, -1, -0.2)
    tree.add(5, -1, -0.3)
    c = tree.add(1, a, -0.4)
    tree.add(3, a, -0.5)
    tree.add(4, c, -0.6)
    return tree


def emitted_pairs(walk, tree: DraftTree, node_probs, num_samples: int, seed: int) -> Counter:
    """Counts of (first emitted token, second emitted token or None)."""
    generator = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for _ in range(num_samples):
        accepted, bonus = walk(tree, node_probs, generator)
        emitted = [tree.tokens[n] for n in accepted] + [bonus]
        counts[(emitted[0], emitted[1] if len(emitted) > 1 else None)] += 1
    return counts


def residual_free_walk(tree: DraftTree, node_probs, generator: torch.Generator):
    """A classic bug: on rejecting every child, draw the bonus from p instead of the residual."""
    accepted, seq_index = [], 0
    children = tree.children()
    while True:
        probs = node_probs(seq_index)
        kids = children[seq_index]
        choice, _ = (
            rejection_step(probs, [tree.tokens[c] for c in kids], generator)
            if kids
            else (None, None)
        )
        if choice is None:
            return accepted, int(torch.multinomial(probs.double(), 1, generator=generator))
        accepted.append(kids[choice])
        seq_index = kids[choice] + 1


def test_tree_walk_emits_the_target_distribution() -> None:
    """First token ~ p(root); after an accepted child c, the next token ~ p(c)."""
    tree = synthetic_tree()
    torch.manual_seed(1)
    probs_SV = torch.distributions.Dirichlet(torch.full((6,), 0.6)).sample((len(tree) + 1,))
    probs_SV[0, 4] = 0.0  # a token the target cannot emit at the root
    probs_SV[0] /= probs_SV[0].sum()
    node_probs = FixedNodeProbs(probs_SV)
    counts = emitted_pairs(sampling_walk, tree, node_probs, 12000, seed=2)
    first = [sum(n for (a, _), n in counts.items() if a == t) for t in range(6)]
    assert chi_square_pvalue(first, probs_SV[0].tolist()) > ALPHA
    # Conditional on the root's first child (token 2, node 0) being emitted, the next token
    # follows that node's distribution (sequence index 1), whether accepted from the tree or not.
    second = [counts.get((2, t), 0) for t in range(6)]
    assert sum(second) > 500
    assert chi_square_pvalue(second, probs_SV[1].tolist()) > ALPHA
    # The same test catches a walk that forgets the residual distribution.
    wrong = emitted_pairs(residual_free_walk, tree, node_probs, 12000, seed=2)
    wrong_first = [sum(n for (a, _), n in wrong.items() if a == t) for t in range(6)]
    assert chi_square_pvalue(wrong_first, probs_SV[0].tolist()) < ALPHA


def tiny_target(seed: int) -> TargetModel:
    """A 2-layer Qwen3 with an 8-token vocabulary and peaked next-token distributions."""
    model = tiny_qwen3(seed, vocab_size=8, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # random init is near-uniform; make the choices matter
    return TargetModel(model, [0, 1])


def exact_joint(target: TargetModel, prompt: list[int], sampling: SamplingConfig, length: int):
    """P(x_1..x_length | prompt) under the target's warped sampling, by enumeration."""
    vocab = target.vocab_size
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        with torch.no_grad():
            logits = target.model(
                input_ids=torch.tensor([prompt + list(p) for p in prefixes])
            ).logits[:, -1]
        probs = warp_logits(logits, sampling.temperature, sampling.top_p).double()
        joint = {
            p + (t,): joint[p] * float(probs[i, t])
            for i, p in enumerate(prefixes)
            for t in range(vocab)
        }
    return joint


@pytest.mark.slow
def test_speculative_sampling_matches_target_sampling() -> None:
    """Joint law of the first 3 generated tokens (the 2nd and 3rd come from verification steps,
    in one multi-token step or two), against the target's exact law. A chain is the tree with
    top_k 1 and runs the same code; the synthetic-walk test above covers other sibling counts."""
    shape, sampling = TreeShape(3, 3, 8), SamplingConfig(0.8, 0.95)
    target = tiny_target(seed=0)
    config = Eagle3Config.from_target_config(target.model.config, aux_layer_ids=[0, 1])
    draft = Eagle3Draft(config)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.input_embeddings())
    drafter = TreeDrafter(draft, target)
    prompt, length = [1, 2, 3, 4, 5], 3
    generator = torch.Generator().manual_seed(3)
    counts: Counter = Counter()
    accepted_steps = 0
    for _ in range(1500):
        result = speculative_generate(
            target, drafter, prompt, shape, sampling, length, set(), generator
        )
        counts[tuple(result.output_ids)] += 1
        accepted_steps += sum(n > 1 for n in result.tokens_per_step)
    assert accepted_steps > 200  # the accept branch is exercised, not only bonus tokens
    joint = exact_joint(target, prompt, sampling, length)
    cells = list(itertools.product(range(target.vocab_size), repeat=length))
    pvalue = chi_square_pvalue([counts.get(c, 0) for c in cells], [joint[c] for c in cells])
    assert pvalue > ALPHA
