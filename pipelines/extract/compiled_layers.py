"""Regional compilation of the target's decoder layers (``model.compile``).

What is compiled: each decoder layer's ``forward``, with ``torch.compile`` (inductor, default mode),
not the whole model. Every layer of a Hugging Face decoder is an instance of one class whose
``forward`` is one code object, so dynamo compiles it once and every layer reuses that graph (the
layer's weights are the graph's inputs, not constants): the compile time is one layer's, whatever
the depth. The embeddings, the rotary tables, the final norm and everything the capture does stay
eager.

Why ``forward`` and not the module (``layer.compile()``): the capture's forward pre-hooks
(capture.py: aux states, the sink's pacing of copies) and a split target's device hooks
(placement.py) live in ``nn.Module.__call__``. Compiling the module would trace them into the graph
(they close over Python state and issue copies on other streams: graph breaks, and a hook attached
per call changes the guards, so a recompile per call). Compiling ``forward`` leaves ``__call__``
and its hooks eager: a pre-hook sees the previous layer's output, a real tensor, as in eager mode.

Shapes: batches are length-sorted under a token budget, so both the batch size and the padded
length change from one batch to the next. Rather than pad lengths to buckets (each bucket and batch
size its own graph and compile, plus the padding), the batch and sequence dims of the layer's
inputs are marked dynamic before the first call, so one dynamic graph serves every batch: the
GEMMs are cuBLAS calls either way, and the fused pointwise kernels (norms, rotary, SiLU-and-mul,
residual adds) take the sizes as arguments. The dims are marked by position (hidden states
``[B, T, H]``, rotary tables ``[.., T, D]``, position ids ``[.., T]``, a 4-d mask ``[B, 1, T, T]``),
not by value: dynamo gives dims of equal size one symbol, so marking every dim that happens to
equal ``T`` (the head dim, or ``H`` itself for a 4,096-token batch) would tie them and specialise
the graph to that length. A batch of one row, or of one token, runs the eager forward: dynamo
specialises sizes 0 and 1, so it would compile a second graph for what is at most a unit's last
batch or an isolated record.

Recompiles are counted (dynamo's graph counter around each compiled call) and logged; past
:data:`MAX_GRAPHS` graphs the layers run eager for the rest of the worker's life, so a model whose
guards change per call cannot spend the run compiling. dynamo's own per-function limit
(``torch._dynamo.config.recompile_limit``, 8) is process-wide and left as it is.

Compiled in the background: the worker starts eager. Its warm-up runs the same forwards as
before, eager, and records the inputs of the first decoder layer's calls (:class:`LayerCallRecorder`);
then :meth:`CompiledDecoderLayers.compile_in_background` replays those calls on a thread of its
own, one layer, under the capture's inference mode, and only that thread's calls go through the
compiler. The worker takes units meanwhile, eager; once every recorded call has compiled, the
compiled forwards serve the next batches (a batch in flight may mix layers of both: each computes
the same function). So the first forward no longer waits for the compile (~15 s on an H200 for the
8B shape), and the GPU is not idle while dynamo and inductor work on the CPU. While the compile
runs, the interpreter switches threads every 0.1 ms (:data:`COMPILE_SWITCH_INTERVAL_S`): at
Python's 5 ms the units' eager forwards waited for the GIL after every op, and ran at a fraction of
their speed beside the compile.

CUDA graphs (``mode="reduce-overhead"``) are not used: a graph is recorded per distinct shape, and
the shapes change every batch; a forward of a 32k-token batch of an 8B model is ~1 s of GEMMs, so
launch overhead is not what limits it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import nn

from pipelines.extract.errors import ExtractionError

logger = logging.getLogger(__name__)

# The interpreter's switch interval while the layers compile in the background (Python's default:
# 5 ms). Every torch op releases the GIL and takes it back; beside a thread that runs Python without
# pause (dynamo and inductor), taking it back waits out the interval, so the eager forwards of the
# units running meanwhile issue about one op per interval: a forward of a 36-layer target is ~1,000
# ops, 5 s of waiting for ~1 s of GPU work. At 0.1 ms the wait per forward is ~0.1 s, hidden behind
# the GPU (benchmarks/LOG.md, 2026-12-03: the GIL convoy).
COMPILE_SWITCH_INTERVAL_S = 1e-4

# Compiled graphs of the decoder layers per worker before it stops compiling (see the module doc):
# one with no attention mask, one with a mask, one per layer class of a model with two (sliding and
# full attention), and one spare.
MAX_GRAPHS = 4


def resolve_compile(setting: bool | str | None, device: torch.device) -> bool:
    """``model.compile``: ``auto`` (or None) compiles on CUDA only (on a CPU inductor builds C++
    kernels with the system compiler: minutes of start-up for a small gain); a bool as given."""
    if isinstance(setting, bool):
        return setting
    if setting not in (None, "auto"):
        raise ValueError(f"model.compile must be true, false or auto, got {setting!r}")
    return device.type == "cuda"


def is_compile_error(err: BaseException | None) -> bool:
    """An error raised by dynamo or inductor (tracing, lowering, a C++/Triton build), as opposed to
    one the model itself would raise eager."""
    while err is not None:
        module = type(err).__module__ or ""
        if module.startswith(("torch._dynamo", "torch._inductor")):
            return True
        err = err.__cause__
    return False


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledDecoderLayers:
    """Each decoder layer's ``forward`` replaced by a compiled one (an instance attribute that
    shadows the class's method); :meth:`restore` puts the eager ones back.

    ``deferred``: the compiled forwards serve no call until :meth:`compile_in_background` has
    compiled them (module doc); until then every call runs eager. ``backend``: torch.compile's
    (tests use ``aot_eager``, which needs no compiler toolchain)."""

    def __init__(
        self, layers: nn.ModuleList, *, max_graphs: int = MAX_GRAPHS, deferred: bool = False,
        backend: str = "inductor",
    ):
        self.layers = layers
        self.max_graphs = max_graphs
        self.backend = backend
        self.num_graphs = 0  # graphs compiled by calls through these layers
        self.disabled = False  # past max_graphs: every layer runs eager
        self.active = not deferred  # the compiled forwards serve every thread's calls
        self._compiling = threading.local()  # .here: this thread is the background compile
        self.compile_seconds = 0.0  # the background compile's, once done
        self.compiled_at = 0.0  # wall clock (time.time()) when it was done
        self._recorder: LayerCallRecorder | None = None
        self._future: Future | None = None
        self.failed = False  # the background compile raised: the layers are eager again
        for layer in layers:
            if "forward" in vars(layer):
                raise ValueError(
                    f"{type(layer).__name__}.forward is already replaced on the instance; "
                    "compile the layers once"
                )
            layer.forward = _CompiledForward(self, layer.forward)

    def note_compiled(self, new_graphs: int, hidden_BTD: torch.Tensor) -> None:
        """Called after a compiled call that compiled ``new_graphs`` graphs."""
        self.num_graphs += new_graphs
        batch, length = hidden_BTD.shape[:2]
        if self.num_graphs <= 1:
            logger.info("compiled the decoder layers on a %d x %d batch", batch, length)
        else:
            logger.warning(
                "recompiled the decoder layers on a %d x %d batch (graph %d of at most %d)",
                batch,
                length,
                self.num_graphs,
                self.max_graphs,
            )
        if self.num_graphs >= self.max_graphs and not self.disabled:
            self.disabled = True
            logger.warning(
                "the decoder layers were compiled %d times; running them eager from now on "
                "(set model.compile: false to skip compiling)",
                self.num_graphs,
            )

    def serves_this_call(self) -> bool:
        """Whether a call on this thread goes through the compiled forward."""
        return not self.disabled and (self.active or getattr(self._compiling, "here", False))

    def record_calls(self) -> None:
        """Record the first layer's inputs from now on (the eager warm-up's calls)."""
        self._recorder = LayerCallRecorder(self.layers[0])

    def compile_in_background(self, device: torch.device, wait: bool = False) -> None:
        """Replay the recorded calls through the first layer on a thread of its own, compiling
        it, then let the compiled forwards serve every call (:meth:`ready` says when). The
        recorded tensors are released as they are replayed. ``wait``: return once compiled."""
        if self._recorder is None:
            raise RuntimeError("record_calls() first: the compile replays the warm-up's calls")
        calls, layer = self._recorder.stop(), self.layers[0]
        self._recorder = None
        # The thread starts on CUDA's default device: name the caller's, index and all
        # (``set_device`` refuses a bare "cuda").
        cuda_index = None
        if device.type == "cuda":
            cuda_index = device.index if device.index is not None else torch.cuda.current_device()

        def compile_all() -> None:
            start = time.perf_counter()
            if cuda_index is not None:
                torch.cuda.set_device(cuda_index)
            self._compiling.here = True
            switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)
            try:
                with torch.inference_mode():  # the capture's mode: the guards must match its calls
                    while calls:
                        args, kwargs = calls.pop(0)
                        layer.forward(*args, **kwargs)  # the forward alone: no hooks run
                if cuda_index is not None:
                    torch.cuda.synchronize(cuda_index)
            finally:
                self._compiling.here = False
                sys.setswitchinterval(switch_interval)
            self.compile_seconds = time.perf_counter() - start
            self.compiled_at = time.time()
            self.active = True
            logger.info("the decoder layers compiled in the background in %.1f s", self.compile_seconds)

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile")
        self._future = pool.submit(compile_all)
        pool.shutdown(wait=wait)  # the thread ends with the compile

    def ready(self, fail_quietly: bool) -> bool:
        """Whether the compiled forwards serve calls now. A failed background compile puts the
        eager layers back and is raised, naming the setting, unless ``fail_quietly`` (``compile:
        auto``) and it is the compiler's own error, which is logged; either way it stays eager."""
        if self.active or self._future is None or self.failed or not self._future.done():
            return self.active
        err = self._future.exception()
        if err is None:
            return self.active
        self.failed = True
        self.restore()
        if fail_quietly and is_compile_error(err):
            logger.warning("model.compile: auto: compiling failed (%s); running the layers eager", _brief(err))
            return False
        raise ExtractionError(
            f"model.compile: compiling the decoder layers failed ({_brief(err)}); "
            "set model.compile: false to run them eager"
        ) from err

    def wait(self) -> None:
        """Wait for a background compile still running (its thread calls into the layers)."""
        if self._future is not None:
            wait([self._future])

    def restore(self) -> None:
        """The layers' own (eager) ``forward`` back; the model is as it was loaded."""
        for layer in self.layers:
            if isinstance(vars(layer).get("forward"), _CompiledForward):
                del layer.forward


def _brief(err: BaseException) -> str:
    """The error's type and first lines (dynamo's messages go on with pages of advice)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()][:2]
    return f"{type(err).__name__}: {' '.join(lines)}"[:400]


class _CompiledForward:
    """One layer's forward: compiled for batches of at least 2 rows and 2 tokens, eager otherwise."""

    def __init__(self, owner: CompiledDecoderLayers, eager: Any):
        self.owner = owner
        self.eager = eager
        self.compiled: Any = None  # torch.compile'd at the first batch that needs it

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.owner.serves_this_call() or hidden_states.dim() != 3 or min(hidden_states.shape[:2]) < 2:
            return self.eager(hidden_states, *args, **kwargs)
        if self.compiled is None:
            self.compiled = torch.compile(self.eager, backend=self.owner.backend)
        mark_dynamic_dims(hidden_states, kwargs)
        before = _graph_count()
        output = self.compiled(hidden_states, *args, **kwargs)
        new_graphs = _graph_count() - before
        if new_graphs:
            self.owner.note_compiled(new_graphs, hidden_states)
        return output


def mark_dynamic_dims(hidden_BTD: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Mark the batch and sequence dims of a decoder layer's inputs dynamic, by position (see the
    module doc): the keyword names are transformers' decoder-layer call convention. Inputs not
    named here are left to dynamo's automatic dynamic shapes."""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(hidden_BTD, 0)
    mark(hidden_BTD, 1)
    rotary = kwargs.get("position_embeddings")
    if isinstance(rotary, tuple | list):
        for table in rotary:
            if isinstance(table, torch.Tensor) and table.dim() >= 2:
                mark(table, table.dim() - 2)  # cos / sin: [.., T, head_dim]
    for name in ("position_ids", "cache_position"):
        positions = kwargs.get(name)
        if isinstance(positions, torch.Tensor) and positions.dim() >= 1:
            mark(positions, positions.dim() - 1)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # [B, 1, T, T]
        for dim in (0, 2, 3):
            mark(mask, dim)


class LayerCallRecorder:
    """The inputs of a decoder layer's first calls of each kind (with and without an attention
    mask; at least 2 rows and 2 tokens, as the compiled forward needs), recorded by a forward
    pre-hook during the eager warm-up: what :meth:`CompiledDecoderLayers.compile_in_background`
    replays. Whatever the transformers version passes a layer is replayed as it was passed."""

    def __init__(self, layer: nn.Module):
        self._calls: dict[bool, tuple[tuple, dict]] = {}
        self._handle = layer.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and min(hidden.shape[:2]) >= 2:
            self._calls.setdefault(kwargs.get("attention_mask") is not None, (args, dict(kwargs)))

    def stop(self) -> list[tuple[tuple, dict]]:
        """Remove the hook; the calls recorded (the unmasked one first)."""
        self._handle.remove()
        return [self._calls[masked] for masked in (False, True) if masked in self._calls]


def compile_warm_up(
    pad_forward: Callable[..., Any],
    rows: int,
    length: int,
    pad_to_multiple_of: int,
    pass_attention_mask: bool,
) -> None:
    """Before the worker's warm-up batch (``rows x length`` pad tokens): the forwards that compile
    the other graphs its units will use, so that no unit waits for a compile. The warm-up batch
    compiles the graph without a mask when it has 2 rows or more; otherwise a 2-row batch of half
    the length does. Where the capture passes a mask, a batch with one padded token compiles the
    graph with one (a batch without padding passes none). ``pad_forward(rows, length,
    mask_last_token=...)`` is the worker's."""
    shape = (rows, length)
    if rows < 2:
        shape = (2, max(2, -(-(length // 2) // pad_to_multiple_of) * pad_to_multiple_of))
        pad_forward(*shape)
    if pass_attention_mask:
        pad_forward(*shape, mask_last_token=True)
