"""Tree building (EAGLE-2), the verification mask and positions, and the greedy walk."""

from __future__ import annotations

import random

import pytest
import torch

from pipelines.evaluate.tree import (
    DraftTree,
    build_dynamic_tree,
    greedy_walk,
    tree_attention_mask,
    tree_position_ids,
)


def random_logprobs(path: tuple[int, ...], vocab: int, seed: int) -> list[float]:
    """A fixed random next-token log-distribution for every path (a stand-in draft)."""
    gen = torch.Generator().manual_seed(hash((seed, path)) % (2**31))
    return torch.log_softmax(torch.randn(vocab, generator=gen) * 2, dim=-1).tolist()


def eagle2_reference(
    vocab: int, seed: int, top_k: int, depth: int, total: int
) -> dict[tuple[int, ...], float]:
    """EAGLE-2 written over token paths, independent of DraftTree's indices."""

    def top(path: tuple[int, ...]) -> list[tuple[tuple[int, ...], float]]:
        logp = random_logprobs(path, vocab, seed)
        best = sorted(range(vocab), key=lambda t: -logp[t])[:top_k]
        return [(path + (t,), logp[t]) for t in best]

    scored: dict[tuple[int, ...], float] = {}
    level = top(())
    scored.update(level)
    for _ in range(1, depth):
        frontier = sorted(level, key=lambda item: -item[1])[:top_k]
        level = [(child, score + lp) for path, score in frontier for child, lp in top(path)]
        scored.update(level)
    best = sorted(scored.items(), key=lambda item: -item[1])[:total]
    return dict(best)


@pytest.mark.parametrize(
    ("top_k", "depth", "total"), [(1, 5, 5), (3, 4, 10), (4, 5, 31), (2, 3, 100)]
)
def test_dynamic_tree_matches_path_reference(top_k: int, depth: int, total: int) -> None:
    vocab, seed = 12, 7

    def path_of(node: int, pool: DraftTree) -> tuple[int, ...]:
        return tuple(pool.tokens[n] for n in pool.ancestors(node))

    def expand(frontier: list[int], pool: DraftTree) -> tuple[list[list[int]], list[list[float]]]:
        tokens, logps = [], []
        for node in frontier:
            logp = random_logprobs(path_of(node, pool), vocab, seed)
            best = sorted(range(vocab), key=lambda t: -logp[t])[:top_k]
            tokens.append(best)
            logps.append([logp[t] for t in best])
        return tokens, logps

    root = random_logprobs((), vocab, seed)
    root_best = sorted(range(vocab), key=lambda t: -root[t])[:top_k]
    tree = build_dynamic_tree(root_best, [root[t] for t in root_best], expand, depth, top_k, total)
    got = {
        tuple(tree.tokens[n] for n in tree.ancestors(i)): tree.scores[i] for i in range(len(tree))
    }
    want = eagle2_reference(vocab, seed, top_k, depth, total)
    assert got.keys() == want.keys()
    for path, score in want.items():
        assert got[path] == pytest.approx(score, abs=1e-9)
    # Topological order, depths, and closure under parents.
    for node, parent in enumerate(tree.parents):
        assert parent < node
        assert tree.depths[node] == (1 if parent < 0 else tree.depths[parent] + 1)
    assert tree.max_depth <= depth and len(tree) == min(total, len(want))


def test_select_breaks_score_ties_towards_parents() -> None:
    pool = DraftTree()
    a = pool.add(5, -1, 0.0)  # log-prob 0: its child ties with it
    pool.add(6, a, 0.0)
    pool.add(7, -1, -0.5)
    tree = pool.select(2)
    assert tree.tokens == [5, 6] and tree.parents == [-1, 0]


def hand_tree() -> DraftTree:
    """root -> a(1) -> c(3) -> d(4);  root -> b(2);  a -> e(5)."""
    tree = DraftTree()
    a = tree.add(1, -1, -0.1)
    tree.add(2, -1, -0.2)
    c = tree.add(3, a, -0.3)
    tree.add(4, c, -0.4)
    tree.add(5, a, -0.5)
    return tree


def test_mask_and_positions_by_hand() -> None:
    tree = hand_tree()
    mask = tree_attention_mask(tree)
    # rows/cols: root, a, b, c, d, e
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert tree_position_ids(tree, 10).tolist() == [10, 11, 11, 12, 13, 12]


def test_mask_rows_are_exactly_the_ancestors_on_random_trees() -> None:
    rng = random.Random(0)
    for _ in range(50):
        tree = DraftTree()
        for _ in range(rng.randint(1, 40)):
            tree.add(rng.randrange(100), rng.randrange(-1, len(tree)), -rng.random())
        mask = tree_attention_mask(tree)
        for node in range(len(tree)):
            visible = {0} | {a + 1 for a in tree.ancestors(node)}
            assert set(torch.nonzero(mask[node + 1]).flatten().tolist()) == visible


def test_greedy_walk_follows_the_target_and_returns_the_bonus() -> None:
    tree = hand_tree()
    # target argmax after: root, a, b, c, d, e  (sequence indices 0..5)
    assert greedy_walk(tree, [1, 3, 0, 4, 9, 0]) == ([0, 2, 3], 9)  # a, c, d accepted; bonus 9
    assert greedy_walk(tree, [2, 0, 8, 0, 0, 0]) == ([1], 8)  # b accepted
    assert greedy_walk(tree, [1, 5, 0, 0, 0, 7]) == ([0, 4], 7)  # a, e accepted
    assert greedy_walk(tree, [6, 0, 0, 0, 0, 0]) == ([], 6)  # nothing accepted
