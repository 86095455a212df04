"""The draft side of speculative decoding: an :class:`Eagle3Draft` proposing token trees.

Alignment (docs/draft-model.md, the same as training): the draft's step-0 entry at position t
takes the target's fused aux state of t and the embedding of token t+1, and predicts token t+2.
Its KV cache therefore holds one entry per position whose aux state and next token are both
known: after the target has run positions ``0..m-1`` and produced token ``x_m`` (the tree's
root), entries ``0..m-1`` exist and the last one's logits give the root's children.

A tree node at depth d (d = 1 for the root's children) is expanded at RoPE position
``m - 1 + d`` with its own token and its parent's draft output as h (TTT step d). It attends
to the step-0 cache (within the sliding window, if the draft has one) plus its ancestors and
itself, which is exactly what TTT step d sees in training. Tree entries are cropped off the
draft cache once the tree is built.
"""

from __future__ import annotations

import logging
import time

import torch

from hsstore.aux_layers import check_aux_layer_ids
from hsstore.errors import AuxLayerError, LineageMismatchError
from pipelines.evaluate.target import TargetModel, synchronize
from pipelines.evaluate.tree import DraftTree, build_dynamic_tree
from pipelines.models.eagle3 import Eagle3Draft

logger = logging.getLogger(__name__)


class DraftMismatchError(LineageMismatchError):
    """The draft was built for another target (vocabulary, width or aux layers do not fit)."""


def check_draft_fits(
    draft: Eagle3Draft,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    source: str = "the draft",
) -> None:
    """Refuse up front a draft that cannot run against a target of this shape; the message
    names each misfit (vocabulary, widths, aux layers, vocabulary mapping)."""
    cfg = draft.config
    problems = []
    if cfg.vocab_size != vocab_size:
        problems.append(
            f"vocab_size {cfg.vocab_size} != the target's vocabulary of {vocab_size} tokens"
        )
    if cfg.target_hidden_size != hidden_size:
        problems.append(
            f"target_hidden_size {cfg.target_hidden_size} != the target's hidden size {hidden_size}"
        )
    if cfg.hidden_size != hidden_size:
        problems.append(
            f"hidden_size {cfg.hidden_size} != the target's {hidden_size} "
            "(the draft embeds tokens with the target's embedding matrix)"
        )
    try:
        check_aux_layer_ids(cfg.aux_layer_ids, num_layers)
    except AuxLayerError:
        bad_layers = [i for i in cfg.aux_layer_ids if not 0 <= i <= num_layers]
        problems.append(
            f"aux_layer_ids {cfg.aux_layer_ids} name layers {bad_layers} outside the target's "
            f"0..{num_layers} (id i = the state entering decoder layer i; {num_layers} = the final norm's output)"
        )
    if not problems:
        max_target_id = int((torch.arange(cfg.draft_vocab_size) + draft.d2t.cpu()).max())
        if max_target_id >= vocab_size:
            problems.append(
                f"d2t maps draft ids onto target id {max_target_id}, outside the target vocabulary"
            )
    if problems:
        raise DraftMismatchError(
            f"{source} does not fit the target ({num_layers} layers, hidden {hidden_size}, "
            f"vocabulary {vocab_size}): " + "; ".join(problems)
        )


class TreeDrafter:
    """Keeps the draft's step-0 KV cache in step with the target and drafts trees from it."""

    def __init__(self, draft: Eagle3Draft, target: TargetModel) -> None:
        check_draft_fits(
            draft,
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            num_layers=target.num_layers,
        )
        self.draft = draft.eval()
        self.device = target.device
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_positions = 0
        self.last_hidden_D: torch.Tensor | None = None
        self.seconds = 0.0
        self.num_forwards = 0

    @property
    def max_top_k(self) -> int:
        """The most children a node can get: the candidate count with a candidate head, else
        the draft vocabulary."""
        if self.draft.candidate_head is not None and self.draft.config.num_candidates:
            return int(self.draft.config.num_candidates)
        return int(self.draft.config.draft_vocab_size)

    def reset(self) -> None:
        self.cache = None
        self.num_positions = 0
        self.last_hidden_D = None

    # ------------------------------------------------------------------------------------------
    # Step 0: follow the committed sequence

    @torch.no_grad()
    def extend(self, aux_QKH: torch.Tensor, next_tokens_Q: torch.Tensor) -> None:
        """Add step-0 entries for the next Q positions: aux of position t, token t+1."""
        start = time.perf_counter()
        num_new = int(aux_QKH.shape[0])
        positions = torch.arange(
            self.num_positions, self.num_positions + num_new, device=self.device
        )
        hidden = self.draft.fuse_aux(aux_QKH.to(self.device)[None])
        out = self.draft(
            next_tokens_Q.to(self.device)[None],
            hidden,
            positions[None],
            attention_mask=None,  # causal (and windowed) over the step-0 cache
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.num_positions += num_new
        self.last_hidden_D = out.hidden_BTD[0, -1]
        self.num_forwards += 1
        synchronize(self.device)
        self.seconds += time.perf_counter() - start

    # ------------------------------------------------------------------------------------------
    # Steps 1..depth-1: expand a tree

    def _top_children(
        self, hidden_FD: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities and TARGET ids of the best ``top_k`` next tokens of each row.

        With a candidate head (EAGLE-4 stage 2), the low-rank logits pick ``num_candidates``
        draft ids, the full lm_head rescores exactly those, and the log-softmax normaliser uses
        the low-rank logits elsewhere (the full vocabulary is never projected, which is the
        head's point); the top_k children come from the exactly rescored candidates.
        """
        draft = self.draft
        if draft.candidate_head is None:
            logp_FV = torch.log_softmax(draft.compute_logits(hidden_FD).float(), dim=-1)
            scores_FK, draft_ids_FK = logp_FV.topk(top_k, dim=-1)
        else:
            num_candidates = int(draft.config.num_candidates or top_k)
            if top_k > num_candidates:
                raise ValueError(
                    f"draft_top_k={top_k} exceeds the draft's candidate head count {num_candidates}"
                )
            normed_FD = draft.head_input(hidden_FD)
            approx_FV = draft.candidate_head(normed_FD).float()
            cand_ids_FC = approx_FV.topk(num_candidates, dim=-1).indices
            exact_FC = torch.einsum(
                "fd,fcd->fc", normed_FD.float(), draft.lm_head.weight[cand_ids_FC].float()
            )
            logits_FV = approx_FV.scatter(-1, cand_ids_FC, exact_FC)
            logp_FC = torch.log_softmax(logits_FV, dim=-1).gather(-1, cand_ids_FC)
            scores_FK, pick_FK = logp_FC.topk(top_k, dim=-1)
            draft_ids_FK = cand_ids_FC.gather(-1, pick_FK)
        return scores_FK, draft.draft_to_target(draft_ids_FK)

    @torch.no_grad()
    def propose(self, top_k: int, depth: int, total_draft_tokens: int) -> DraftTree:
        """Draft an EAGLE-2 tree below the root (the last committed token).

        Depth 1 comes from the last step-0 output; each further depth costs one draft forward
        over the current frontier (``top_k`` nodes). Returns the best ``total_draft_tokens``
        nodes of everything drafted.
        """
        assert self.cache is not None and self.last_hidden_D is not None, "extend() first"
        start = time.perf_counter()
        scores_K, tokens_K = self._top_children(self.last_hidden_D[None], top_k)
        output_hidden: dict[int, torch.Tensor] = {}  # expanded node -> its draft output h
        cache_index: dict[int, int] = {}  # pool node -> its entry in the draft cache
        kv = self.cache
        num_prefix = self.num_positions
        window = self.draft.config.sliding_window
        window_mode = self.draft.config.window_mode

        def expand(
            frontier: list[int], pool: DraftTree
        ) -> tuple[list[list[int]], list[list[float]]]:
            nonlocal kv
            num_cached, num_front = kv[0].shape[2], len(frontier)
            position = num_prefix - 1 + pool.depths[frontier[0]]  # the frontier shares a depth
            # As in TTT: a step-0 key at position p is visible iff end - p < window, where the
            # window ends at the root (window_mode "context": W context keys, as eagle-harness
            # serves) or at the node itself ("position"); its drafted ancestors always are.
            end = position if window_mode == "position" else num_prefix - 1
            visible_from = 0 if window is None else max(0, end - window + 1)
            mask_FS = torch.zeros(num_front, num_cached + num_front, dtype=torch.bool)
            mask_FS[:, visible_from:num_prefix] = True
            for row, node in enumerate(frontier):
                for ancestor in pool.ancestors(node)[:-1]:
                    mask_FS[row, cache_index[ancestor]] = True
                mask_FS[row, num_cached + row] = True
                cache_index[node] = num_cached + row
            # TTT step d feeds back the parent's output (the root's: the last step-0 output).
            hidden_FD = torch.stack(
                [output_hidden.get(pool.parents[n], self.last_hidden_D) for n in frontier]
            )
            out = self.draft(
                torch.tensor([pool.tokens[n] for n in frontier], device=self.device)[None],
                hidden_FD[None],
                torch.full((1, num_front), position, device=self.device),
                attention_mask=mask_FS.to(self.device)[None],
                past_key_values=kv,
                use_cache=True,
            )
            self.num_forwards += 1
            kv = out.past_key_values
            for row, node in enumerate(frontier):
                output_hidden[node] = out.hidden_BTD[0, row]
            scores_FK, tokens_FK = self._top_children(out.hidden_BTD[0], top_k)
            return tokens_FK.tolist(), scores_FK.tolist()

        tree = build_dynamic_tree(
            tokens_K[0].tolist(), scores_K[0].tolist(), expand, depth, top_k, total_draft_tokens
        )
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return tree
