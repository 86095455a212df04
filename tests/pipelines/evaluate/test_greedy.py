"""Greedy speculative decoding reproduces target-only greedy decoding token for token.

On the reference target in float32 on the CPU, against ``model.generate(do_sample=False)``:
with an untrained (random) draft, which is almost never accepted, and with a proposer that
plants the true continuation in random trees, so that long paths are accepted at every depth
and sibling rank and the cache gather is exercised on every step.
"""

from __future__ import annotations

import pytest
import torch

from pipelines.evaluate.decoding import (
    SamplingConfig,
    TreeShape,
    eos_token_ids,
    speculative_generate,
    target_only_generate,
)
from pipelines.evaluate.drafter import TreeDrafter
from pipelines.evaluate.target import TargetModel
from tests.pipelines.evaluate.helpers import RandomTreeProposer, one_thread, random_draft

MAX_NEW_TOKENS = 32
SHAPES = [TreeShape(1, 5, 5), TreeShape(8, 5, 31), TreeShape(3, 7, 12)]


@pytest.fixture(scope="module")
def generate_reference(reference_sdpa: TargetModel, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Target-only greedy outputs (generated ids only) of the first 12 prompts."""
    outputs = []
    for ids in prompt_ids[:12]:
        with torch.no_grad(), one_thread():
            out = reference_sdpa.model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


@pytest.mark.slow
def test_random_draft_reproduces_generate(
    reference_sdpa: TargetModel, prompt_ids: list[list[int]], generate_reference: list[list[int]]
) -> None:
    target = reference_sdpa
    drafter = TreeDrafter(random_draft(target, seed=5), target)
    eos, generator = eos_token_ids(target.model), torch.Generator().manual_seed(0)
    for i, want in enumerate(generate_reference[:6]):
        shape = SHAPES[i % 2]  # chains and trees alternate over the prompts
        got = speculative_generate(
            target, drafter, prompt_ids[i], shape, SamplingConfig(), MAX_NEW_TOKENS, eos, generator
        )
        assert got.output_ids == want, f"prompt {i}, {shape}"
        if i < 2:  # the baseline loop that speedups divide by decodes the same tokens
            baseline = target_only_generate(
                target, prompt_ids[i], SamplingConfig(), MAX_NEW_TOKENS, eos, generator
            )
            assert baseline.output_ids == want


@pytest.mark.slow
def test_accepted_paths_reproduce_generate(
    reference_sdpa: TargetModel, prompt_ids: list[list[int]], generate_reference: list[list[int]]
) -> None:
    target = reference_sdpa
    eos, generator = eos_token_ids(target.model), torch.Generator().manual_seed(0)
    tokens_per_step: list[int] = []
    for i, want in enumerate(generate_reference):
        truth = prompt_ids[i] + want
        for j, shape in enumerate(SHAPES):
            proposer = RandomTreeProposer(target.vocab_size, seed=100 * i + j, truth=truth)
            got = speculative_generate(
                target,
                proposer,
                prompt_ids[i],
                shape,
                SamplingConfig(),
                MAX_NEW_TOKENS,
                eos,
                generator,
            )
            assert got.output_ids == want, f"prompt {i}, {shape}"
            tokens_per_step += got.tokens_per_step
            # Every verification emitted at least the bonus token and at most depth + 1.
            assert all(1 <= n <= shape.depth + 1 for n in got.tokens_per_step)
    # Long accepted paths really happened (the planted path has a random depth 0..depth).
    assert max(tokens_per_step) >= 6 and sum(tokens_per_step) / len(tokens_per_step) > 2.0
