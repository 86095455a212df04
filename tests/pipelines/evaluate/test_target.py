"""Tree verification on the reference target: one masked forward equals running each path alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.evaluate.target import TargetModel, TargetModelError
from pipelines.evaluate.tree import DraftTree, tree_attention_mask, tree_position_ids
from tests.pipelines.evaluate.helpers import RandomTreeProposer


def path_reference(target: TargetModel, prefix: list[int], root: int, tree: DraftTree):
    """Slow reference: each node's logits and aux states from a plain causal forward over
    ``prefix + root + its root-to-node path``, no cache, no custom mask."""
    logits, aux = [], []
    for node in [None, *range(len(tree))]:
        path = [] if node is None else [tree.tokens[n] for n in tree.ancestors(node)]
        ids = torch.tensor([prefix + [root] + path])
        with torch.no_grad():
            out = target.model(input_ids=ids, output_hidden_states=True)
        logits.append(out.logits[0, -1])
        aux.append(torch.stack([out.hidden_states[i][0, -1] for i in target.aux_layer_ids]))
    return torch.stack(logits), torch.stack(aux)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_tree_forward_equals_each_path_run_alone(
    implementation: str, request: pytest.FixtureRequest, prompt_ids: list[list[int]]
) -> None:
    target: TargetModel = request.getfixturevalue(f"reference_{implementation}")
    prefix = prompt_ids[0][:40]
    proposer = RandomTreeProposer(target.vocab_size, seed=1)
    for shape in [(4, 4, 15), (1, 5, 5), (8, 3, 24)]:
        tree = proposer.propose(*shape)
        target.reset()
        target.forward(torch.tensor(prefix))
        root = 17
        out = target.forward(
            torch.tensor([root] + tree.tokens),
            tree_position_ids(tree, len(prefix)),
            tree_attention_mask(tree),
        )
        ref_logits, ref_aux = path_reference(target, prefix, root, tree)
        torch.testing.assert_close(out.logits_QV, ref_logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(out.aux_QKH, ref_aux, atol=2e-4, rtol=1e-4)


def test_keep_leaves_the_cache_of_sequential_decoding(
    reference_sdpa: TargetModel, prompt_ids: list[list[int]]
) -> None:
    """After keeping an accepted path, the next forward sees exactly prefix + root + path."""
    target = reference_sdpa
    prefix = prompt_ids[1][:30]
    tree = RandomTreeProposer(target.vocab_size, seed=2).propose(3, 4, 12)
    deepest = max(range(len(tree)), key=lambda n: tree.depths[n])
    path = tree.ancestors(deepest)
    target.reset()
    target.forward(torch.tensor(prefix))
    target.forward(
        torch.tensor([99] + tree.tokens),
        tree_position_ids(tree, len(prefix)),
        tree_attention_mask(tree),
    )
    target.keep(len(prefix), torch.tensor([0] + [n + 1 for n in path]))
    assert target.seq_length == len(prefix) + 1 + len(path)
    after = target.forward(torch.tensor([5, 6]))
    full = prefix + [99] + [tree.tokens[n] for n in path] + [5, 6]
    with torch.no_grad():
        want = target.model(input_ids=torch.tensor([full])).logits[0, -2:]
    torch.testing.assert_close(after.logits_QV, want, atol=2e-4, rtol=1e-4)


def test_attention_without_custom_masks_is_refused(reference_target: Path) -> None:
    with pytest.raises(TargetModelError, match="cannot take a custom tree mask"):
        TargetModel.from_pretrained(
            reference_target, [2, 4, 5], attn_implementation="flash_attention_2"
        )


def test_aux_layers_outside_the_target_are_refused(reference_sdpa: TargetModel) -> None:
    """0..L as extraction accepts (hsstore.aux_layers): 8 is the 8-layer target's final norm output."""
    assert TargetModel(reference_sdpa.model, [2, 4, 8]).aux_layer_ids == [2, 4, 8]
    with pytest.raises(TargetModelError, match=r"aux layer ids \[9\] out of range: this model has 8 decoder layers"):
        TargetModel(reference_sdpa.model, [2, 4, 9])
