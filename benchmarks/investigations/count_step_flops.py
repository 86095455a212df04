"""Matmul FLOPs of one training step, counted by ``torch.utils.flop_counter.FlopCounterMode`` on
the CPU (issue 31): the objective's forward and backward at the Qwen3-8B shape (or ``--shape
reference``), ``--tokens`` positions of one row of which the last ``--scored`` fraction is in the
loss mask (as a chat's answer), ``compile: off`` (sparse scoring, as ``layers``), the final-state
teacher as computed today (its logits once a step, at the positions whose next token is scored)
and as before 2026-12-05 (:func:`benchmarks.train.profile_step.teacher_as_before_12_05`: per
depth, the validity check over every position), beside
:func:`benchmarks.train.profile_step.step_flops_per_token`'s count.

    python -m benchmarks.investigations.count_step_flops --tokens 128 [--scored 0.25]  # ~45 s, ~14 GB

Counts, not times: the number of FLOPs a step does does not depend on the machine (attention's
score products grow with the tokens: at 128 they are a fraction of a percent).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.train.profile_step import (
    SHAPES,
    step_flops_per_token,
    synthetic_batch,
    teacher_as_before_12_05,
)
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.train.objective import DraftObjective
from pipelines.train.teacher import TeacherHead


def count(shape: str, tokens: int, draft_vocab: int, scored: float = 1.0, ttt_length: int = 7) -> dict[str, float]:
    """GFLOP per token of one forward + backward, the teacher as today and as before."""
    torch.manual_seed(0)
    cfg = Eagle3Config(**SHAPES[shape], draft_vocab_size=draft_vocab, aux_layer_ids=[2, 18, 33])
    draft = Eagle3Draft(cfg)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.02
    lm_head[:draft_vocab] *= 3.0  # most argmaxes inside the draft vocabulary, as profile_step's
    head = TeacherHead(lm_head, draft.d2t, draft.t2d)
    batch = synthetic_batch(1, tokens, cfg, torch.device("cpu"))
    # The last `scored` of the row in the loss mask (the row is one document at these lengths).
    loss_mask = torch.arange(tokens)[None, :] >= round((1.0 - scored) * tokens)
    features = {"aux_hidden_states": batch["aux"].float(), "final_hidden_state": batch["final"].float()}
    result: dict[str, float] = {}
    try:
        for name, before in (("teacher_today", False), ("teacher_before", True)):
            teacher_as_before_12_05(before)
            objective = DraftObjective(draft, "final_hidden", head, ttt_length=ttt_length, attention="eager")
            with FlopCounterMode(display=False) as counter:
                out = objective(features, batch["input_ids"], batch["position_ids"], loss_mask, batch["doc_ids"])
                sums = zip(out.loss_sums, out.counts, strict=True)
                sum(0.8**i * s / c.clamp(min=1) for i, (s, c) in enumerate(sums)).backward()
            draft.zero_grad(set_to_none=True)
            result[f"{name}_gflop_per_token"] = round(counter.get_total_flops() / tokens / 1e9, 3)
    finally:
        teacher_as_before_12_05(False)
    result["formula_gflop_per_token"] = round(step_flops_per_token(cfg, ttt_length, scored) / 1e9, 3)
    result["today_over_before"] = round(result["teacher_today_gflop_per_token"]
                                        / result["teacher_before_gflop_per_token"], 4)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--scored", type=float, default=1.0, help="fraction of the row in the loss mask")
    args = parser.parse_args(argv)
    print(json.dumps({"shape": args.shape, "tokens": args.tokens, "draft_vocab": args.draft_vocab, "scored": args.scored,
                      **count(args.shape, args.tokens, args.draft_vocab, args.scored)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
