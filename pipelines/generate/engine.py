"""Batched generation with a KV cache on a transformers causal LM: hsstore's own decode loop.

Why not ``model.generate``: its sampler draws from one global RNG, so a sampled answer would
depend on which answers shared its batch; here every answer has its own generator, seeded from
the record (prompts.answer_seed), so a rerun regenerates the same text. The loop also drops
finished answers from the batch (and their KV cache rows) once half of it has finished, instead
of decoding padding until the longest answer ends.

Prompts are length-sorted and cut into batches of at most ``max_batch_size`` answers and
``token_budget`` tokens of KV cache ((longest prompt + max_new_tokens) x batch), left-padded so
every answer's next token sits in the last column.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pipelines.generate.prompts import FINISH_LENGTH, FINISH_STOP, Answer, Request

BatchCallback = Callable[[int, int], None]  # (answers, new tokens) after each batch

# Compact the batch (drop finished rows and their cache) when at most this share is still running.
COMPACT_BELOW = 0.5

# The attention kernels the loop lets SDPA choose from on CUDA (None: torch's own choice).
# "no-cudnn": flash, memory-efficient and math. Measured on an H200 (benchmarks/LOG.md, 2026-12-04):
# cuDNN builds a plan per new (batch, key length), which a decode meets every step, so a process's
# first pass over new shapes took 1.9-3.0x its later ones; without it the first pass is not slower,
# but every later one is 7-34% slower: torch's choice is kept (a long job meets its shapes once).
DECODE_SDPA: str | None = None

# "preallocated" (kv_cache.py: one buffer per layer, written in place) or "dynamic" (transformers'
# DynamicCache: each layer's whole cache concatenated every step). Measured (benchmarks/LOG.md,
# 2026-12-04): on the CPU preallocated is 1.29-1.72x; on an H200 1.09-1.12x for the reference target
# at batch 1,024 with 300-1,500-token prompts, level at the 8B shape, and 0.93x with short
# (150-250-token) prompts, where the concatenation is cheap and attention over the buffer's strided
# views is not.
KV_CACHE = "preallocated"


def new_cache(config: object, capacity: int) -> object:
    """The KV cache of one batch (``KV_CACHE``) for up to ``capacity`` tokens a row."""
    from pipelines.generate.kv_cache import preallocated_cache

    if KV_CACHE == "preallocated":
        return preallocated_cache(config, capacity)
    from transformers import DynamicCache

    return DynamicCache(config=config)


@contextmanager
def decode_attention(device: torch.device) -> Iterator[None]:
    """The SDPA kernels of one batch's prefill and decode steps (``DECODE_SDPA``)."""
    if device.type != "cuda" or DECODE_SDPA is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        yield


@dataclass(frozen=True)
class SamplingParams:
    """The decode rule: greedy at temperature 0, else temperature / top-k / top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choose_next(
    logits_BV: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """The next token of each row: argmax, or one draw per row from its own (CPU) generator.

    A draw is one uniform number from the row's generator, mapped through the row's cumulative
    distribution, all rows at once. One ``torch.multinomial`` per row (before 2026-12-05) cost
    ~0.27 ms a row on the CPU (136 ms a step at batch 512, 30x the argmax) and a few kernel launches
    a row on a GPU. The generators live on the CPU, so an answer's draws do not depend on the device.
    """
    if params.greedy:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / params.temperature
    if params.top_k and params.top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, params.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs_BV, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter(-1, order, sorted_probs)
    uniform_B = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators])
    # float32: a token's interval is off by a rounding or two (~1e-7), and float64 took 10x as
    # long on the CPU (22 of 39 ms a step at batch 512).
    cdf_BV = probs_BV.cumsum(dim=-1)
    # The first token whose cumulative mass passes u x total: a token of zero mass (cut by top-k
    # or top-p) spans an empty interval and is never the first. The target stays below the total
    # (u < 1 rounded to float32 could reach it), where only tokens of zero mass would follow.
    total_B1 = cdf_BV[:, -1:]
    uniform_B1 = uniform_B.to(cdf_BV.device, torch.float32, non_blocking=True).unsqueeze(1)
    targets_B1 = torch.minimum(uniform_B1 * total_B1, torch.nextafter(total_B1, torch.zeros_like(total_B1)))
    return torch.searchsorted(cdf_BV, targets_B1, right=True).squeeze(1)


def plan_generation_batches(
    requests: Sequence[Request], max_batch_size: int, token_budget: int, max_padding_share: float = 1.0
) -> list[list[int]]:
    """Request indices, longest prompt first, cut so that each batch's KV cache fits the budget and
    padding is at most ``max_padding_share`` of its prefill (left padding costs compute there)."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0  # the batch's longest prompt + max_new_tokens
    prompt_width = real_tokens = 0
    for i in order:
        length = len(requests[i].prompt_ids)
        need = length + requests[i].max_new_tokens
        count = len(current) + 1
        too_big = max(width, need) * count > token_budget or count > max_batch_size
        padded = max(prompt_width, length) * count
        too_padded = padded - (real_tokens + length) > max_padding_share * padded
        if current and (too_big or too_padded):
            batches.append(current)
            current, width, prompt_width, real_tokens = [], 0, 0, 0
        current.append(i)
        width = max(width, need)
        prompt_width = max(prompt_width, length)
        real_tokens += length
    if current:
        batches.append(current)
    return batches


class BatchGenerator:
    """Generates answers with one model; ``generate`` is the backend interface of the worker."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        *,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        params: SamplingParams,
        max_batch_size: int,
        token_budget: int,
        max_padding_share: float = 1.0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.stop_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=self.device)
        self.pad_token_id = pad_token_id
        self.params = params
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.max_padding_share = max_padding_share
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name
        # warns, and goes in 5.40); older versions know only the old one.
        import inspect

        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def generate(self, requests: Sequence[Request], on_batch: BatchCallback | None = None) -> list[Answer]:
        answers: list[Answer | None] = [None] * len(requests)
        for batch in plan_generation_batches(
            requests, self.max_batch_size, self.token_budget, self.max_padding_share
        ):
            token_lists, finishes = self.generate_ids([requests[i] for i in batch])
            num_new = 0
            for i, ids, finish in zip(batch, token_lists, finishes, strict=True):
                text = self.tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
                answers[i] = Answer(text=text, num_new_tokens=len(ids), finish_reason=finish)
                num_new += len(ids)
            if on_batch is not None:
                on_batch(len(batch), num_new)
        return [a for a in answers if a is not None]

    @torch.inference_mode()
    def generate_ids(self, requests: Sequence[Request]) -> tuple[list[list[int]], list[str]]:
        """New token ids (without the stop token) and finish reason of each request of one batch."""
        with decode_attention(self.device):
            return self._generate_ids(requests)

    def _generate_ids(self, requests: Sequence[Request]) -> tuple[list[list[int]], list[str]]:
        batch_size = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((batch_size, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, request in enumerate(requests):
            input_ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention_mask[row, width - len(request.prompt_ids) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = [None if self.params.greedy else self._generator(r.seed) for r in requests]
        limits = torch.tensor([r.max_new_tokens for r in requests], device=self.device)
        rows = torch.arange(batch_size, device=self.device)  # request index of each live row
        new_tokens = torch.full(
            (batch_size, int(limits.max())), -1, dtype=torch.long, device=self.device
        )
        cache = new_cache(self.model.config, width + int(limits.max()))
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        ).logits[:, -1]
        alive = torch.ones(batch_size, dtype=torch.bool, device=self.device)  # per live row
        step = 0
        while True:
            next_ids = choose_next(logits, self.params, generators)
            # torch.where, not boolean indexing: that would sync the host with the device.
            new_tokens[rows, step] = torch.where(alive, next_ids, new_tokens[rows, step])
            stopped = alive & torch.isin(next_ids, self.stop_ids)
            ended = stopped | (alive & (limits[rows] <= step + 1))
            alive &= ~ended
            step += 1
            num_alive = int(alive.sum())  # the step's one host sync
            if num_alive == 0:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
            if num_alive <= COMPACT_BELOW * len(rows):
                keep = alive.nonzero().flatten()
                cache.batch_select_indices(keep)
                running = keep.tolist()
                rows, next_ids, alive = rows[keep], next_ids[keep], alive[keep]
                attention_mask, position_ids = attention_mask[keep], position_ids[keep]
                generators = [generators[i] for i in running]
            logits = self.model(
                input_ids=next_ids[:, None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{self._cache_kwarg: cache},
            ).logits[:, -1]
        return self._collect(new_tokens)

    def _collect(self, new_tokens: torch.Tensor) -> tuple[list[list[int]], list[str]]:
        """Each row up to its stop token (not text) or its last written token (-1 after it)."""
        stop_set = set(self.stop_ids.tolist())
        out: list[list[int]] = []
        finish: list[str] = []
        for row in new_tokens.tolist():
            ids: list[int] = []
            reason = FINISH_LENGTH
            for token in row:
                if token < 0:
                    break
                if token in stop_set:
                    reason = FINISH_STOP
                    break
                ids.append(token)
            out.append(ids)
            finish.append(reason)
        return out, finish

    def _generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator()  # on the CPU: choose_next draws its uniforms there
        generator.manual_seed(seed)
        return generator
