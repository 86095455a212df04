"""``run_evaluation(recipe)``: load target and draft, decode every prompt per setting, report.

Each setting decodes the same prompts (batch size 1) with the same seed; target-only decoding
of those prompts, once per distinct (temperature, top_p), gives the tokens/s that speedup
divides by and, for greedy settings, the reference every output is compared with.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hsstore
from hsstore.errors import RecipeError
from pipelines.evaluate.decoding import (
    GenerationResult,
    SamplingConfig,
    TreeShape,
    eos_token_ids,
    speculative_generate,
    target_only_generate,
)
from pipelines.evaluate.drafter import TreeDrafter, check_draft_fits
from pipelines.evaluate.metrics import greedy_agreement, report_text, summarize, summarize_baseline
from pipelines.evaluate.prompts import Prompt, load_prompts
from pipelines.evaluate.recipe import DecodeSetting, EvaluateRecipe
from pipelines.evaluate.target import (
    TargetModel,
    load_causal_lm,
    resolve_device,
    resolve_dtype,
    vocab_size_of,
)
from pipelines.models.eagle3 import Eagle3Draft
from pipelines.recipe import dump_recipe

logger = logging.getLogger(__name__)

RESULTS_JSON = "evaluation_results.json"
RESULTS_TXT = "evaluation_results.txt"


def load_evaluation_draft(
    path: str,
    target_model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    aux_layer_ids: list[int] | None = None,
) -> tuple[Eagle3Draft, str]:
    """Load a project checkpoint or an exported eagle3/eagle4 dir and check it fits the target.

    Exported drafts omit ``embed_tokens`` (the engines share the target's), so the target's are
    installed; a project checkpoint keeps its own, copied from its target at training time, and
    a difference from this target's is reported (it was likely trained for another model).
    """
    from pipelines.models.checkpoint import CONFIG_NAME, load_draft, resolve_draft_dir
    from pipelines.models.serving_layout import is_serving_config

    directory = resolve_draft_dir(path)
    exported = is_serving_config(json.loads((directory / CONFIG_NAME).read_text()))
    embed = target_model.get_input_embeddings().weight.detach()
    draft = load_draft(
        directory,
        device=device,
        dtype=dtype,
        embed_tokens=embed if exported else None,
        aux_layer_ids=aux_layer_ids,
    )
    text_config = target_model.config.get_text_config(decoder=True)
    check_draft_fits(
        draft,
        vocab_size=vocab_size_of(target_model),
        hidden_size=int(text_config.hidden_size),
        num_layers=int(text_config.num_hidden_layers),
        source=f"draft {directory}",
    )
    if not exported:
        ours = draft.embed_tokens.weight.float()
        theirs = embed.to(ours.device).float()
        if ours.shape == theirs.shape and not torch.allclose(ours, theirs, atol=1e-2, rtol=1e-2):
            logger.warning(
                "draft %s: its embed_tokens differ from the target's (max |diff| %.3g); was it "
                "trained for another target?",
                directory,
                float((ours - theirs).abs().max()),
            )
    return draft.eval(), ("exported" if exported else "project")


def _decode_all(prompts: list[Prompt], decode: Any, warmup_tokens: int) -> list[GenerationResult]:
    if warmup_tokens and prompts:
        decode(prompts[0], warmup_tokens)  # untimed: first-call kernel selection and allocation
    return [decode(p, None) for p in prompts]


@dataclass
class EvaluationSession:
    """What every setting decodes with: the target, the draft and its drafter, the prompts."""

    recipe: EvaluateRecipe
    device: torch.device
    draft: Eagle3Draft
    draft_format: str  # "exported" or "project"
    target: TargetModel
    drafter: TreeDrafter
    prompts: list[Prompt]
    eos: set[int]  # the target's stop tokens
    proxy_store: hsstore.Store | None  # the offline proxy's store, opened first: a missing one fails early


def run_evaluation(recipe: EvaluateRecipe) -> dict[str, Any]:
    """Decode every prompt with every setting; write and return the results dict."""
    session = open_session(recipe)
    # Target-only decoding, once per distinct (temperature, top_p), shared by the settings.
    baselines: dict[tuple[float, float], list[GenerationResult]] = {}
    settings_out = [evaluate_setting(session, setting, baselines) for setting in recipe.settings]
    proxy = None
    if recipe.proxy is not None:
        from pipelines.evaluate.proxy import offline_proxy

        proxy = offline_proxy(
            session.draft, recipe.proxy, recipe.target, recipe.settings, session.device, session.proxy_store
        )
    results = results_dict(session, settings_out, proxy)
    write_results(results, recipe)
    return results


def open_session(recipe: EvaluateRecipe) -> EvaluationSession:
    """Load the target and the draft, check they fit (and the settings, and the proxy store's
    layers), tokenize the prompts."""
    from transformers import AutoTokenizer

    device, dtype = resolve_device(recipe.device), resolve_dtype(recipe.dtype)
    torch.manual_seed(recipe.seed)
    proxy_store = None
    if recipe.proxy is not None:
        from pipelines.evaluate.proxy import open_proxy_store

        proxy_store = open_proxy_store(recipe.proxy)  # a missing store fails now, not after decoding
    model = load_causal_lm(recipe.target, dtype, device, recipe.attn_implementation)
    draft, draft_format = load_evaluation_draft(recipe.draft, model, dtype, device, recipe.aux_layer_ids)
    if recipe.proxy is not None and proxy_store is not None:
        from pipelines.evaluate.proxy import check_proxy_layers

        check_proxy_layers(proxy_store, recipe.proxy, draft)
    target = TargetModel(model, list(draft.config.aux_layer_ids))
    drafter = TreeDrafter(draft, target)
    for i, setting in enumerate(recipe.settings):
        if setting.top_k > drafter.max_top_k:
            raise RecipeError(
                f"settings.{i} ({setting.label}): draft_top_k={setting.top_k} exceeds the "
                f"{drafter.max_top_k} candidates this draft can rank"
            )
    prompts = load_prompts(recipe.prompts, AutoTokenizer.from_pretrained(recipe.target), recipe.limit)
    logger.info(
        "evaluating %s (%s) on %s with %d prompts, %d settings",
        recipe.draft, draft_format, recipe.target, len(prompts), len(recipe.settings),
    )
    return EvaluationSession(
        recipe=recipe, device=device, draft=draft, draft_format=draft_format, target=target, drafter=drafter,
        prompts=prompts, eos=eos_token_ids(model), proxy_store=proxy_store,
    )


def evaluate_setting(
    session: EvaluationSession,
    setting: DecodeSetting,
    baselines: dict[tuple[float, float], list[GenerationResult]],
) -> dict[str, Any]:
    """Speculative decoding of every prompt with one setting; with ``recipe.baseline``, compared
    with target-only decoding at the same sampling (computed once per sampling, into ``baselines``)."""
    recipe, prompts = session.recipe, session.prompts
    sampling = SamplingConfig(setting.temperature, setting.top_p)
    shape = TreeShape(setting.top_k, setting.depth, setting.num_nodes)
    generator = torch.Generator().manual_seed(recipe.seed)

    def speculative(prompt: Prompt, cap: int | None) -> GenerationResult:
        return speculative_generate(
            session.target, session.drafter, prompt.input_ids, shape, sampling,
            cap or recipe.max_new_tokens, session.eos, generator,
        )

    results = _decode_all(prompts, speculative, recipe.warmup_tokens)
    summary: dict[str, Any] = {
        "name": setting.label,
        "draft_top_k": shape.top_k,
        "draft_depth": shape.depth,
        "total_draft_tokens": shape.total_draft_tokens,
        "chain": setting.num_draft_tokens is not None,
        "temperature": setting.temperature,
        "top_p": setting.top_p,
        **summarize(results),
    }
    if recipe.baseline:
        key = (setting.temperature, setting.top_p)
        if key not in baselines:
            baselines[key] = _target_only(session, sampling)
        summary.update(_compare_with_baseline(summary, results, baselines[key], prompts, sampling))
    if recipe.save_outputs:
        summary["outputs"] = [
            {"id": p.id, "output_ids": r.output_ids} for p, r in zip(prompts, results, strict=True)
        ]
    logger.info(
        "%s: acceptance length %.3f, %.1f tokens/s%s",
        setting.label,
        summary["acceptance_length"] or 0.0,
        summary["tokens_per_second"] or 0.0,
        f", speedup {summary['speedup']:.2f}x" if summary.get("speedup") else "",
    )
    return summary


def _target_only(session: EvaluationSession, sampling: SamplingConfig) -> list[GenerationResult]:
    """Every prompt decoded by the target alone (same seed): the speed and output references."""
    recipe = session.recipe
    generator = torch.Generator().manual_seed(recipe.seed)

    def plain(prompt: Prompt, cap: int | None) -> GenerationResult:
        return target_only_generate(
            session.target, prompt.input_ids, sampling, cap or recipe.max_new_tokens, session.eos, generator
        )

    return _decode_all(session.prompts, plain, recipe.warmup_tokens)


def _compare_with_baseline(
    summary: dict[str, Any],
    results: list[GenerationResult],
    baseline: list[GenerationResult],
    prompts: list[Prompt],
    sampling: SamplingConfig,
) -> dict[str, Any]:
    """``target_only``, ``speedup`` (when both speeds are known) and, greedy, ``greedy_agreement``."""
    base = summarize_baseline(baseline)
    compared: dict[str, Any] = {"target_only": base}
    if summary["tokens_per_second"] and base["tokens_per_second"]:
        compared["speedup"] = summary["tokens_per_second"] / base["tokens_per_second"]
    if sampling.greedy:
        compared["greedy_agreement"] = greedy_agreement(
            [p.id for p in prompts], [r.output_ids for r in results], [r.output_ids for r in baseline]
        )
    return compared


def results_dict(
    session: EvaluationSession, settings_out: list[dict[str, Any]], proxy: dict[str, Any] | None
) -> dict[str, Any]:
    """What ``evaluation_results.json`` holds: the run's configuration, every setting, the proxy."""
    recipe = session.recipe
    acceptance = {s["name"]: s["acceptance_length"] for s in settings_out}
    results: dict[str, Any] = {
        "target": recipe.target,
        "draft": recipe.draft,
        "draft_format": session.draft_format,
        "prompts": recipe.prompts,
        "num_prompts": len(session.prompts),
        "max_new_tokens": recipe.max_new_tokens,
        "device": str(session.device),
        "dtype": recipe.dtype,
        "attn_implementation": recipe.attn_implementation,
        "batch_size": 1,
        "seed": recipe.seed,
        "acceptance_length": next(iter(acceptance.values())) if len(acceptance) == 1 else acceptance,
        "settings": settings_out,
        "offline_proxy": proxy,
    }
    if recipe.save_outputs:
        # The first setting's outputs at the top level; every setting carries its own.
        results["outputs"] = settings_out[0]["outputs"]
    return results


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_results(results: dict[str, Any], recipe: EvaluateRecipe) -> Path:
    """``evaluation_results.json`` / ``.txt`` and the resolved recipe, in ``output_dir``."""
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, out / "evaluate_recipe.yaml")
    _atomic_write(out / RESULTS_JSON, json.dumps(results, indent=2) + "\n")
    _atomic_write(out / RESULTS_TXT, report_text(results))
    return out
