"""The draft side: tree expansion equals a per-path slow reference; misfit drafts are refused."""

from __future__ import annotations

import pytest
import torch

from pipelines.evaluate.drafter import DraftMismatchError, TreeDrafter
from pipelines.evaluate.target import TargetModel
from pipelines.models.eagle3 import Eagle3Draft
from tests.pipelines.evaluate.helpers import random_draft


@torch.no_grad()
def step0(draft: Eagle3Draft, target: TargetModel, prompt: list[int], root: int):
    """Target prefill then the draft's step-0 pass over the prompt: cache and last output."""
    target.reset()
    aux = target.forward(torch.tensor(prompt)).aux_QKH
    out = draft(
        torch.tensor([prompt[1:] + [root]]),
        draft.fuse_aux(aux[None]),
        torch.arange(len(prompt))[None],
        use_cache=True,
    )
    return out.past_key_values, out.hidden_BTD[0, -1]


@torch.no_grad()
def path_logprobs(
    draft: Eagle3Draft, kv, last_hidden, path: list[int], start: int, window: int | None
):
    """Log-probs after each prefix of ``path``, stepping one node at a time: node i (depth i+1)
    sees the step-0 keys within the window (ending at the root ``start`` in window_mode
    "context", at the node's own position in "position") and every earlier node of its path."""
    num_prefix = kv[0].shape[2]
    logps = [torch.log_softmax(draft.compute_logits(last_hidden).float(), -1)]
    hidden = last_hidden
    for i, token in enumerate(path):
        position = start + i + 1
        mask = torch.ones(1, 1, num_prefix + i + 1, dtype=torch.bool)
        if window is not None:
            end = position if draft.config.window_mode == "position" else start
            mask[..., : max(0, end - window + 1)] = False
        out = draft(
            torch.tensor([[token]]),
            hidden[None, None],
            torch.tensor([[position]]),
            attention_mask=mask,
            past_key_values=kv,
            use_cache=True,
        )
        kv, hidden = out.past_key_values, out.hidden_BTD[0, -1]
        logps.append(torch.log_softmax(draft.compute_logits(hidden).float(), -1))
    return logps


@pytest.mark.parametrize(("window", "mode"), [(None, "context"), (8, "context"), (8, "position")])
def test_tree_scores_equal_each_path_drafted_alone(
    window: int | None, mode: str, reference_sdpa: TargetModel, prompt_ids: list[list[int]]
) -> None:
    target = reference_sdpa
    draft = random_draft(target, seed=3, sliding_window=window, window_mode=mode)
    prompt, root = prompt_ids[2][:24], 42
    drafter = TreeDrafter(draft, target)
    target.reset()
    prefill = target.forward(torch.tensor(prompt))
    drafter.extend(prefill.aux_QKH, torch.tensor(prompt[1:] + [root]))
    # 3 + 3 * (3 * 3) nodes are drafted; keeping them all puts every depth under test.
    tree = drafter.propose(top_k=3, depth=4, total_draft_tokens=40)
    assert len(tree) == 30 and tree.max_depth == 4
    assert drafter.cache[0].shape[2] == len(prompt)  # tree entries were cropped off
    kv, last_hidden = step0(draft, target, prompt, root)
    assert not draft.d2t.any()  # identity vocabulary: draft id == target id
    for node in range(len(tree)):
        path = [tree.tokens[n] for n in tree.ancestors(node)]
        logps = path_logprobs(draft, kv, last_hidden, path[:-1], len(prompt) - 1, window)
        want = sum(float(logps[i][t]) for i, t in enumerate(path))
        assert tree.scores[node] == pytest.approx(want, abs=1e-4)
        # A node's token is among the top_k of its parent's distribution.
        assert path[-1] in logps[-1].topk(3).indices.tolist()


def test_candidate_head_rescores_its_candidates_exactly(
    reference_sdpa: TargetModel, prompt_ids: list[list[int]]
) -> None:
    """With num_candidates = the whole vocabulary, the rescored head IS the full head."""
    target = reference_sdpa
    full = random_draft(target, seed=4)
    with_head = random_draft(target, seed=4, candidate_rank=16, num_candidates=target.vocab_size)
    with_head.load_state_dict(full.state_dict(), strict=False)
    prompt = prompt_ids[3][:20]
    trees = []
    for draft in (full, with_head):
        drafter = TreeDrafter(draft, target)
        target.reset()
        drafter.extend(target.forward(torch.tensor(prompt)).aux_QKH, torch.tensor(prompt[1:] + [7]))
        trees.append(drafter.propose(top_k=4, depth=3, total_draft_tokens=10))
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
    assert trees[0].scores == pytest.approx(trees[1].scores, abs=1e-4)
    # A small candidate set proposes only tokens the low-rank head ranks in its top K.
    small = random_draft(target, seed=4, candidate_rank=16, num_candidates=6)
    drafter = TreeDrafter(small, target)
    target.reset()
    prefill = target.forward(torch.tensor(prompt))
    drafter.extend(prefill.aux_QKH, torch.tensor(prompt[1:] + [7]))
    tree = drafter.propose(top_k=4, depth=1, total_draft_tokens=4)
    approx = small.compute_candidate_logits(drafter.last_hidden_D)
    assert set(tree.tokens) <= set(approx.topk(6).indices.tolist())
    with pytest.raises(
        ValueError, match="draft_top_k=8 exceeds the draft's candidate head count 6"
    ):
        drafter.propose(top_k=8, depth=1, total_draft_tokens=8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"vocab_size": 4096, "draft_vocab_size": 4096},
            r"vocab_size 4096 != the target's vocabulary of 8192",
        ),
        ({"target_hidden_size": 256}, r"target_hidden_size 256 != the target's hidden size 384"),
        ({"aux_layer_ids": [2, 4, 9]}, r"aux_layer_ids \[2, 4, 9\] name layers \[9\] outside"),
    ],
)
def test_misfit_drafts_are_refused(
    overrides: dict, message: str, reference_sdpa: TargetModel
) -> None:
    from pipelines.models.eagle3 import Eagle3Config

    config = Eagle3Config.from_target_config(reference_sdpa.model.config, aux_layer_ids=[2, 4, 5])
    draft = Eagle3Draft(config.model_copy(update=overrides))
    with pytest.raises(DraftMismatchError, match=message):
        TreeDrafter(draft, reference_sdpa)


@pytest.mark.parametrize(
    ("window", "options"),
    [
        (None, {}),
        (8, {"window_mode": "context"}),
        (8, {"window_mode": "position"}),
        (8, {"fc_norm": True, "norm_output": True}),  # EAGLE-3.1
    ],
)
def test_chain_drafting_equals_the_trainers_ttt_unroll(
    window: int | None, options: dict, reference_sdpa: TargetModel, prompt_ids: list[list[int]]
) -> None:
    """Decoding sees exactly what training taught: the drafter's chain scores equal the TTT
    unroll (pipelines.train.ttt, written independently) over the sequence the chain spells out."""
    from pipelines.train.ttt import ttt_unroll

    target = reference_sdpa
    draft = random_draft(target, seed=8, sliding_window=window, **options)
    prompt, root = prompt_ids[4][:30], 123
    drafter = TreeDrafter(draft, target)
    target.reset()
    drafter.extend(target.forward(torch.tensor(prompt)).aux_QKH, torch.tensor(prompt[1:] + [root]))
    chain = drafter.propose(top_k=1, depth=5, total_draft_tokens=5)
    assert chain.depths == [1, 2, 3, 4, 5]
    sequence = prompt + [root] + chain.tokens
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
        aux = torch.stack([out.hidden_states[i] for i in target.aux_layer_ids], dim=2)
        hidden = ttt_unroll(
            draft, aux, torch.tensor([sequence]), torch.arange(len(sequence))[None], ttt_length=5
        )
    t = len(prompt) - 1  # the last step-0 position: its depth-i output predicts chain token i+1
    cumulative = 0.0
    for depth, token in enumerate(chain.tokens):
        with torch.no_grad():
            logp = torch.log_softmax(draft.compute_logits(hidden[depth][0, t]).float(), -1)
        assert int(logp.argmax()) == token
        cumulative += float(logp[token])
        assert chain.scores[depth] == pytest.approx(cumulative, abs=1e-4)
