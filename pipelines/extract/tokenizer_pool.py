"""Tokenizing records in a pool of processes, in order, for the streaming planner.

The pool's processes come from a fork server that has imported the tokenizer's module once (its
class's own module, or AutoTokenizer's, which brings torch: see tokenizer_loader): each worker
shares those pages with it instead of paying for its own, so memory grows by little more than a
tokenizer per core. The server is a fresh process, not a fork of the driver, so it inherits neither
Ray's threads nor the driver's tokenizer state. This module stays light for the workers: no model
code, no store code.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.records import Rejection
from pipelines.extract.tokenize import SampleTokenizer
from pipelines.extract.tokenizer_loader import load_tokenizer, tokenizer_module
from pipelines.target_identity import chat_template_sha256, tokenizer_sha256


def make_sample_tokenizer(recipe: ExtractRecipe, tokenizer_dir: str) -> SampleTokenizer:
    """The recipe's tokenization, with the tokenizer and template hashes folded into sample ids."""
    tokenizer = load_tokenizer(tokenizer_dir, recipe.model.trust_remote_code)
    return SampleTokenizer(
        tokenizer,
        max_length=recipe.batching.max_length,
        too_long=recipe.batching.too_long,
        loss_mask=recipe.tokenizer.loss_mask,
        chat_template_kwargs=recipe.tokenizer.chat_template_kwargs,
        identity={
            "tokenizer_sha256": tokenizer_sha256(tokenizer_dir),
            "chat_template_sha256": chat_template_sha256(getattr(tokenizer, "chat_template", None)),
        },
    )


_WORKER_TOKENIZER: SampleTokenizer | None = None


def _init_worker(recipe_json: str, tokenizer_dir: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = make_sample_tokenizer(ExtractRecipe.model_validate_json(recipe_json), tokenizer_dir)


def _tokenize_in_worker(block: list[Any]) -> list[Any]:
    assert _WORKER_TOKENIZER is not None
    return tokenize_block(_WORKER_TOKENIZER, block)


def tokenize_block(tokenizer: SampleTokenizer, block: list[Any]) -> list[Any]:
    """Each record tokenized (a TokenizedSample or a Rejection); rejections pass through."""
    return [item if isinstance(item, Rejection) else tokenizer(item) for item in block]


class BlockTokenizer:
    """Tokenizes blocks of records in order: the first block in this process (small inputs never
    start a pool), later ones in ``num_workers`` processes, at most two blocks per process ahead.

    The pool starts, on a thread, as soon as the first block is full (more blocks may follow), so
    that its processes come up while that block is tokenized here: on a 16-core H200 host the fork
    server's start and the workers' tokenizers took 3.6 s, which a job of one sort window (all of
    it planned before its first unit) waited for in full (benchmarks/LOG.md, 2026-12-04)."""

    def __init__(self, tokenizer: SampleTokenizer, recipe: ExtractRecipe, tokenizer_dir: str, num_workers: int):
        self.tokenizer = tokenizer
        self.recipe = recipe
        self.tokenizer_dir = tokenizer_dir
        self.num_workers = num_workers
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # the starting thread and the planner's may both ask
        # close() calls so far: a background start that a close overtook must not open a pool
        # nobody closes (the planner itself may map again after a close and gets a new pool).
        self._closes = 0

    def map(self, items: Iterable[Any]) -> Iterator[Any]:
        """``items``: blocks (lists of records) and markers; yields each block's results (a list)
        and passes markers through, in order."""
        ahead: deque[Any] = deque()
        first = True
        for item in items:
            if not isinstance(item, list):
                ahead.append(item)
            elif first or self.num_workers <= 1:
                if first and self.num_workers > 1 and len(item) >= self.recipe.planning.block_records:
                    self._start_in_background()
                first = False
                ahead.append(tokenize_block(self.tokenizer, item))
            else:
                ahead.append(self._ensure_pool().submit(_tokenize_in_worker, item))
            while ahead and (len(ahead) > 2 * self.num_workers or not _pending(ahead[0])):
                yield _result(ahead.popleft())
        while ahead:
            yield _result(ahead.popleft())

    def _start_in_background(self) -> None:
        """Every worker process started (and its tokenizer loaded) on a daemon thread; a failure
        there surfaces where the planner submits its next block."""

        closes = self._closes

        def start() -> None:
            try:
                pool = self._ensure_pool(unless_closed_since=closes)
                # Each submit with no idle worker starts one more process, up to num_workers.
                for future in [pool.submit(_ready) for _ in range(self.num_workers)]:
                    future.exception()
            except RuntimeError:  # planning ended (close) before the pool or its processes had started
                pass

        threading.Thread(target=start, name="tokenizer-pool-start", daemon=True).start()

    def _ensure_pool(self, unless_closed_since: int | None = None) -> ProcessPoolExecutor:
        with self._pool_lock:
            if unless_closed_since is not None and self._closes != unless_closed_since:
                raise RuntimeError("the tokenizer pool was closed")
            if self._pool is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(["pipelines.extract.tokenizer_pool", tokenizer_module(self.tokenizer_dir)])
                self._pool = ProcessPoolExecutor(
                    self.num_workers,
                    mp_context=context,
                    initializer=_init_worker,
                    initargs=(self.recipe.model_dump_json(), self.tokenizer_dir),
                )
            return self._pool

    def close(self) -> None:
        """The pool shut down without waiting for its processes to exit: exiting took 5.0 s on the
        H200 host (each worker's tokenizer and modules torn down), seconds the driver would spend
        not handing out units; Python joins them at its own exit."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            self._closes += 1
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _ready() -> None:
    """A task that only makes the pool start a process (and run its initializer)."""


def _pending(item: Any) -> bool:
    return isinstance(item, Future) and not item.done()


def _result(item: Any) -> Any:
    return item.result() if isinstance(item, Future) else item
