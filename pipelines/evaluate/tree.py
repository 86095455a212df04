"""Draft token trees: EAGLE-2 selection, the verification mask and positions, the greedy walk.

A tree is verified as one sequence ``[root, node_0, ..., node_{N-1}]``: the root is the last
committed token (not yet run through the target) and the nodes are draft tokens, parents before
children. Node ``j`` sits at sequence index ``j + 1``. A chain is the tree with one child per
node (``top_k = 1``), so chain and tree decoding share every line of code.

EAGLE-2's dynamic tree (Li et al., 2024; QAIRT's "Eaglet" recipe uses the same three knobs):
expand the ``top_k`` best children of each frontier node, keep the ``top_k`` best of those
(by cumulative draft log-probability) as the next frontier, repeat to ``depth``; then keep the
``total_draft_tokens`` best of all nodes drafted. Cumulative log-probability never increases
along a path, so the best-N set is closed under taking parents (ties go to the node drafted
first, i.e. the parent), and the result is a tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Draft nodes in topological order (each parent before its children)."""

    tokens: list[int] = field(default_factory=list)  # target-vocabulary ids
    parents: list[int] = field(default_factory=list)  # index of the parent node, -1 = the root
    depths: list[int] = field(default_factory=list)  # 1 = child of the root
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        """Append a node and return its index."""
        depth = 1 if parent < 0 else self.depths[parent] + 1
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(depth)
        self.scores.append(float(score))
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def children(self) -> list[list[int]]:
        """``children()[j + 1]`` lists node j's children, ``children()[0]`` the root's, best first.

        Sibling order is the order rejection sampling tries them in, so it is by score (ties by
        creation order), which is also the order EAGLE-2 drafted them in.
        """
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for node, parent in enumerate(self.parents):
            kids[parent + 1].append(node)
        for siblings in kids:
            siblings.sort(key=lambda n: (-self.scores[n], n))
        return kids

    def ancestors(self, node: int) -> list[int]:
        """Root-to-node path of node indices (root excluded, the node included)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def select(self, num_nodes: int) -> DraftTree:
        """The subtree of the ``num_nodes`` best nodes by cumulative score (EAGLE-2's rerank).

        Ties prefer the earlier-drafted node so that a kept node's parent is always kept too;
        the result is re-indexed in topological order (by depth, then score).
        """
        ranked = sorted(range(len(self)), key=lambda n: (-self.scores[n], n))[:num_nodes]
        kept = set(ranked)
        for node in ranked:
            parent = self.parents[node]
            # Holds because scores never increase along a path; an internal invariant.
            assert parent < 0 or parent in kept, "EAGLE-2 selection dropped a kept node's parent"
        order = sorted(kept, key=lambda n: (self.depths[n], -self.scores[n], n))
        new_index = {old: new for new, old in enumerate(order)}
        tree = DraftTree()
        for old in order:
            parent = self.parents[old]
            tree.add(self.tokens[old], new_index[parent] if parent >= 0 else -1, self.scores[old])
        return tree


# expand(frontier, pool) -> per frontier node: (child target ids, child log-probs), best first.
ExpandFn = Callable[[list[int], "DraftTree"], tuple[list[list[int]], list[list[float]]]]


def build_dynamic_tree(
    root_tokens: list[int],
    root_logprobs: list[float],
    expand: ExpandFn,
    depth: int,
    top_k: int,
    total_draft_tokens: int,
) -> DraftTree:
    """EAGLE-2's dynamic tree from the root's best ``top_k`` children and an expansion function.

    Each of the ``depth - 1`` expansions asks ``expand`` for the ``top_k`` best children of
    every frontier node (one draft forward), scores them by cumulative log-probability, and
    keeps the ``top_k`` best as the next frontier. All drafted nodes compete in the final
    ``select(total_draft_tokens)``.
    """
    pool = DraftTree()
    frontier = [pool.add(t, -1, s) for t, s in zip(root_tokens, root_logprobs, strict=True)]
    for _ in range(1, depth):
        tokens_FK, logprobs_FK = expand(frontier, pool)
        children = []
        for node, tokens, logprobs in zip(frontier, tokens_FK, logprobs_FK, strict=True):
            for token, logprob in zip(tokens, logprobs, strict=True):
                children.append(pool.add(token, node, pool.scores[node] + logprob))
        frontier = sorted(children, key=lambda n: (-pool.scores[n], n))[:top_k]
    return pool.select(total_draft_tokens)


def tree_attention_mask(tree: DraftTree, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[N + 1, N + 1]`` over ``[root, nodes]``: each token sees the root, its ancestors
    and itself (True = may attend). The committed cache before the root is visible to all and
    is not part of this matrix."""
    size = len(tree) + 1
    rows = [[False] * size for _ in range(size)]
    rows[0][0] = True
    for node, parent in enumerate(tree.parents):
        row = rows[node + 1]
        row[:] = rows[parent + 1]  # the parent's row: root and the parent's ancestors
        row[node + 1] = True
    return torch.tensor(rows, dtype=torch.bool, device=device)


def tree_position_ids(
    tree: DraftTree, root_position: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Position ids of ``[root, nodes]``: the root's position plus each node's depth."""
    return torch.tensor([root_position] + [root_position + d for d in tree.depths], device=device)


def greedy_walk(tree: DraftTree, target_next_S: list[int]) -> tuple[list[int], int]:
    """Follow the target's own greedy choices down the tree.

    ``target_next_S[s]`` is the target's argmax after sequence index ``s`` (0 = root). Returns
    the accepted nodes (root-to-leaf order) and the bonus token: the target's choice after the
    last accepted node, which no child matched. The emitted tokens are exactly what target-only
    greedy decoding emits, since each accepted node equals the target's argmax at its parent.
    """
    children = tree.children()
    accepted: list[int] = []
    seq_index = 0
    while True:
        wanted = target_next_S[seq_index]
        match = next((c for c in children[seq_index] if tree.tokens[c] == wanted), None)
        if match is None:
            return accepted, wanted
        accepted.append(match)
        seq_index = match + 1
