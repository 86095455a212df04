"""``model.compile``: the recipe option, its ``auto`` resolution, the compiled layers' eager paths,
and (slow: inductor builds C++ kernels on the CPU) an extraction of the reference target with
compiled layers against the eager one and the float32 truth."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelines.extract import compiled_layers, run_extraction
from pipelines.extract.compiled_layers import (
    CompiledDecoderLayers,
    compile_warm_up,
    is_compile_error,
    resolve_compile,
)
from pipelines.extract.errors import ExtractionError
from pipelines.extract.target import load_target
from pipelines.extract.worker_spec import WorkerSpec
from pipelines.recipe import RecipeError
from tests.pipelines.extract.conftest import MIXED_RECORDS, write_jsonl
from tests.pipelines.extract.helpers import (
    make_recipe,
    plain_hidden_states,
    relative_error,
    stored_samples,
)
from tests.support import models
from tests.support.paths import REFERENCE_TARGET


def test_auto_compiles_on_cuda_only() -> None:
    assert resolve_compile("auto", torch.device("cuda", 0)) is True
    assert resolve_compile(None, torch.device("cuda")) is True
    assert resolve_compile("auto", torch.device("cpu")) is False
    assert resolve_compile(True, torch.device("cpu")) is True
    assert resolve_compile(False, torch.device("cuda")) is False
    with pytest.raises(ValueError, match="model.compile must be true, false or auto"):
        resolve_compile("yes", torch.device("cpu"))


def test_the_recipe_option_reaches_the_worker(tmp_path: Path) -> None:
    def spec_of(**model: object) -> WorkerSpec:
        recipe = make_recipe(REFERENCE_TARGET, [tmp_path / "data.jsonl"], tmp_path / "store", model=model)
        return WorkerSpec.from_recipe(recipe, target_dir=str(REFERENCE_TARGET), features=[], aux_layer_ids=[2], pad_token_id=0)

    assert spec_of().compile == "auto"  # the recipe's default
    assert spec_of().compile_backend == "inductor"
    assert spec_of(compile=True, compile_backend="aot_eager").compile_backend == "aot_eager"
    assert spec_of(compile=True).compile is True and spec_of(compile=False).compile is False
    with pytest.raises(RecipeError, match="model.compile"):
        spec_of(compile="sometimes")
    # A spec built by hand (benchmarks sharing the model with a bare forward) stays eager.
    assert WorkerSpec(target="t", store="s", features=(), aux_layer_ids=()).compile is False


def test_one_row_or_one_token_runs_eager_and_restore_puts_the_layers_back() -> None:
    """Batches dynamo would specialise (a size of 1) never reach the compiler; restore() leaves
    the model as it was loaded."""
    model = models.tiny_qwen3(embed_scale=20.0)
    layers = model.model.layers
    with torch.inference_mode():
        single_row, single_token = torch.randint(0, 64, (1, 12)), torch.randint(0, 64, (3, 1))
        expected = [model.model(input_ids=ids, use_cache=False).last_hidden_state for ids in (single_row, single_token)]
        compiled = CompiledDecoderLayers(layers)
        assert all("forward" in vars(layer) for layer in layers)
        for ids, eager in zip((single_row, single_token), expected, strict=True):
            torch.testing.assert_close(model.model(input_ids=ids, use_cache=False).last_hidden_state, eager, rtol=0, atol=0)
        # Nothing was handed to torch.compile (it is built at the first batch that needs it).
        assert compiled.num_graphs == 0 and all(layer.forward.compiled is None for layer in layers)
    with pytest.raises(ValueError, match="already replaced"):
        CompiledDecoderLayers(layers)
    compiled.restore()
    assert not any("forward" in vars(layer) for layer in layers)


def test_the_warm_up_compiles_every_graph_the_units_use() -> None:
    """The warm-up batch compiles the unmasked graph when it has 2 rows; otherwise a 2-row batch
    of half its length does; with a mask passed, one padded batch compiles the masked graph."""
    calls: list[tuple[int, int, bool]] = []

    def pad_forward(rows: int, length: int, mask_last_token: bool = False) -> None:
        calls.append((rows, length, mask_last_token))

    compile_warm_up(pad_forward, 8, 4096, 8, pass_attention_mask=False)
    assert calls == []  # the warm-up batch itself (8 x 4096) compiles the one graph
    compile_warm_up(pad_forward, 1, 4000, 64, pass_attention_mask=False)
    assert calls == [(2, 2048, False)]
    calls.clear()
    compile_warm_up(pad_forward, 4, 512, 8, pass_attention_mask=True)
    assert calls == [(4, 512, True)]


def test_compile_errors_are_told_from_the_models_own() -> None:
    from torch._dynamo.exc import TorchDynamoException

    assert is_compile_error(TorchDynamoException("could not trace"))
    try:
        try:
            raise TorchDynamoException("could not trace")
        except TorchDynamoException as err:
            raise ExtractionError("model.compile: compiling the decoder layers failed") from err
    except ExtractionError as wrapped:
        assert is_compile_error(wrapped)
    assert not is_compile_error(RuntimeError("shape mismatch"))
    assert not is_compile_error(None)


@pytest.mark.slow
def test_compiled_extraction_equals_eager_within_bf16(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The reference target in bf16 on the CPU; after the warm-up's 2 x 256 batch, the units of
    64 tokens make batches of 2 x 40 and 2 x 16 (compiled) and 1 x 48 (eager: one row): one
    compiled graph serves every batch, the hooks capture from the compiled layers, and every
    feature is as close to the float32 truth as the eager forward's. The compiled run waits for its
    compile (``compile_in_background: false``), so that every unit runs compiled."""
    data = write_jsonl(tmp_path / "mixed.jsonl", MIXED_RECORDS)
    stores = {}
    for compile_layers in (False, True):
        recipe = make_recipe(
            REFERENCE_TARGET, [data], tmp_path / f"store-{compile_layers}",
            model={"dtype": "bfloat16", "compile": compile_layers, "compile_in_background": False},
            capture={"aux_layer_ids": None}, units={"max_tokens": 64},
        )
        with caplog.at_level(logging.INFO, logger="pipelines.extract.compiled_layers"):
            summary = run_extraction(recipe)
        assert summary.num_samples_written == len(MIXED_RECORDS)
        assert summary.compiled is compile_layers
        stores[compile_layers] = stored_samples(recipe.store)
    assert summary.compiled_graphs == 1 and summary.warmup_seconds > 0
    assert summary.units_run_eager_while_compiling == 0 and summary.compile_seconds > 0
    assert f"compiled in the background in {summary.compile_seconds:.1f} s" in summary.format()
    assert "recompiled" not in caplog.text and "compiled the decoder layers" in caplog.text

    model32 = load_target(str(REFERENCE_TARGET), dtype="float32")
    worst = 0.0
    for source_id, compiled in stores[True].items():
        eager = stores[False][source_id]
        truth = plain_hidden_states(model32, compiled["input_ids"])
        for k, layer_id in enumerate([2, 4, 5]):
            own = relative_error(eager["aux_hidden_states"][:, k], truth[layer_id])
            assert relative_error(compiled["aux_hidden_states"][:, k], truth[layer_id]) < 1.5 * own + 2e-3
        own = relative_error(eager["final_hidden_state"], truth[-1])
        assert relative_error(compiled["final_hidden_state"], truth[-1]) < 1.5 * own + 2e-3
        for name in ("aux_hidden_states", "final_hidden_state"):
            worst = max(worst, relative_error(compiled[name], eager[name]))
    assert 0 < worst < 4e-2, f"compiled vs eager: {worst:.2e}"  # two bf16 roundings apart, no more


def _layer_calls(model: torch.nn.Module, compiled: CompiledDecoderLayers) -> None:
    """Two forwards (2 x 12, 3 x 20) whose first-layer inputs the background compile replays."""
    compiled.record_calls()
    with torch.inference_mode():
        for shape in ((2, 12), (3, 20)):
            model.model(input_ids=torch.randint(0, 64, shape), use_cache=False)


def test_the_layers_compile_in_the_background_and_take_over_once_compiled() -> None:
    """The warm-up's layer inputs are recorded; until their replay on the compile thread is done,
    every other thread's calls run eager (no graph); then the compiled forwards serve them, with
    the one graph the replay compiled, and compute what eager does."""
    torch._dynamo.reset()
    model = models.tiny_qwen3(embed_scale=20.0)
    ids = torch.randint(0, 64, (4, 16))
    with torch.inference_mode():
        eager = model.model(input_ids=ids, use_cache=False).last_hidden_state
    compiled = CompiledDecoderLayers(model.model.layers, deferred=True, backend="aot_eager")
    try:
        _layer_calls(model, compiled)
        assert compiled.num_graphs == 0 and not compiled.ready(fail_quietly=True)  # recorded, eager
        compiled.compile_in_background(torch.device("cpu"), wait=True)
        assert compiled.ready(fail_quietly=False) and compiled.num_graphs == 1 and compiled.compile_seconds > 0
        with torch.inference_mode():
            got = model.model(input_ids=ids, use_cache=False).last_hidden_state
        assert compiled.num_graphs == 1  # another shape, the same dynamic graph: no recompile
        assert all(layer.forward.compiled is not None for layer in model.model.layers[:1])
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    finally:
        compiled.restore()


def test_the_background_compile_shortens_the_switch_interval_while_it_runs() -> None:
    """While dynamo and inductor run on the compile thread, the interpreter switches threads every
    0.1 ms instead of 5, so the units' eager ops get the GIL back quickly (the module's
    COMPILE_SWITCH_INTERVAL_S); the interval is restored once the compile is done, or has failed."""
    seen: list[float] = []

    def watching_backend(graph: torch.fx.GraphModule, inputs: list) -> Any:
        seen.append(sys.getswitchinterval())
        if len(seen) > 1:
            raise RuntimeError("the second compile fails")
        return graph.forward

    before = sys.getswitchinterval()
    for _ in range(2):  # compiles, then fails
        torch._dynamo.reset()
        model = models.tiny_qwen3(embed_scale=20.0)
        compiled = CompiledDecoderLayers(model.model.layers, deferred=True, backend=watching_backend)
        _layer_calls(model, compiled)
        compiled.compile_in_background(torch.device("cpu"), wait=True)
        compiled.ready(fail_quietly=True)
        compiled.restore()
        assert sys.getswitchinterval() == before
    assert seen == pytest.approx([compiled_layers.COMPILE_SWITCH_INTERVAL_S] * 2, rel=1e-3) and before > 10 * seen[0]


@pytest.mark.gpu
def test_the_background_compile_takes_a_cuda_device_without_an_index() -> None:
    """The worker's device is ``cuda`` (no index); the compile thread must name one to
    ``set_device``, which refuses a bare ``cuda`` (the H200 run of 2026-12-03 failed so)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    device = torch.device("cuda")
    model = models.tiny_qwen3(embed_scale=20.0).to(device)
    compiled = CompiledDecoderLayers(model.model.layers, deferred=True, backend="aot_eager")
    try:
        compiled.record_calls()
        with torch.inference_mode():
            model.model(input_ids=torch.randint(0, 64, (2, 12), device=device), use_cache=False)
        compiled.compile_in_background(device, wait=True)
        assert compiled.ready(fail_quietly=False) and compiled.num_graphs == 1
    finally:
        compiled.restore()


def test_a_failed_background_compile_runs_eager_under_auto_and_raises_when_asked_for() -> None:
    """A compile that fails on its thread surfaces when the worker next asks (``ready``): under
    ``auto`` the layers go back to eager for good, logged; ``compile: true`` raises, naming the
    setting and the compiler's error."""
    def broken_backend(graph: torch.fx.GraphModule, inputs: list) -> None:
        raise RuntimeError("no kernels today")

    for fail_quietly in (True, False):
        torch._dynamo.reset()
        model = models.tiny_qwen3(embed_scale=20.0)
        compiled = CompiledDecoderLayers(model.model.layers, deferred=True, backend=broken_backend)
        _layer_calls(model, compiled)
        compiled.compile_in_background(torch.device("cpu"), wait=True)
        if fail_quietly:
            assert compiled.ready(fail_quietly=True) is False and compiled.failed
            assert compiled.ready(fail_quietly=True) is False  # settled: eager for good
        else:
            with pytest.raises(ExtractionError, match="model.compile: compiling the decoder layers failed .BackendCompilerFailed: .*no kernels today"):
                compiled.ready(fail_quietly=False)
        assert not any("forward" in vars(layer) for layer in model.model.layers)  # the eager layers back
