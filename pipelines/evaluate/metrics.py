"""Acceptance metrics over many prompts, and the plain-text report.

Definitions (the way serving engines report them):

- ``acceptance_length``: tokens emitted per verification forward, the bonus token included
  (Qualcomm's "block efficiency"; vLLM/SGLang's "accept length"), summed over all prompts then
  divided. It counts what each step produced before the output is cut at EOS or
  ``max_new_tokens``, and it leaves out each prompt's prefill forward (which emits one token
  without any draft).
- ``acceptance_rate_per_depth[d-1]``: of the steps whose walk reached depth d-1 (and whose tree
  had a node at depth d), the share that accepted a token at depth d.
- ``accepted_at_depth[d-1]``: the share of all steps that accepted at least d draft tokens.
"""

from __future__ import annotations

from typing import Any

from pipelines.evaluate.decoding import GenerationResult


def _rate(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarize(results: list[GenerationResult]) -> dict[str, Any]:
    """Pool one setting's per-prompt results."""
    steps = [n for r in results for n in r.tokens_per_step]
    max_depth = max((len(r.depth_attempts) for r in results), default=0)
    attempts = [
        sum(r.depth_attempts[d] for r in results if d < len(r.depth_attempts))
        for d in range(max_depth)
    ]
    accepts = [
        sum(r.depth_accepts[d] for r in results if d < len(r.depth_accepts))
        for d in range(max_depth)
    ]
    generated = sum(len(r.output_ids) for r in results)
    wall = sum(r.wall_seconds for r in results)
    return {
        "acceptance_length": _rate(sum(steps), len(steps)),
        "acceptance_rate_per_depth": [_rate(a, n) for a, n in zip(accepts, attempts, strict=True)],
        "accepted_at_depth": [_rate(a, len(steps)) for a in accepts],
        "num_prompts": len(results),
        "generated_tokens": generated,
        "num_target_forwards": sum(r.num_target_forwards for r in results),
        "num_draft_forwards": sum(r.num_draft_forwards for r in results),
        "draft_tokens_verified": sum(r.num_tree_nodes for r in results),
        "wall_seconds": wall,
        "target_seconds": sum(r.target_seconds for r in results),
        "draft_seconds": sum(r.draft_seconds for r in results),
        "tokens_per_second": _rate(generated, wall),
    }


def summarize_baseline(results: list[GenerationResult]) -> dict[str, Any]:
    generated = sum(len(r.output_ids) for r in results)
    wall = sum(r.wall_seconds for r in results)
    return {
        "generated_tokens": generated,
        "num_target_forwards": sum(r.num_target_forwards for r in results),
        "wall_seconds": wall,
        "tokens_per_second": _rate(generated, wall),
    }


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first differing generated token (None when identical)."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def greedy_agreement(
    ids: list[str], speculative: list[list[int]], target_only: list[list[int]]
) -> dict[str, Any]:
    """How often, and where, greedy speculative output first differs from target-only greedy.

    In float32 they agree token for token; in bf16 the tree forward's different reduction order
    can flip a near-tie argmax, after which the two continuations part ways.
    """
    diverged = []
    for prompt_id, got, want in zip(ids, speculative, target_only, strict=True):
        index = first_divergence(got, want)
        if index is not None:
            diverged.append({"id": prompt_id, "first_divergence": index})
    return {
        "identical": len(ids) - len(diverged),
        "num_prompts": len(ids),
        "diverged": diverged,
    }


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report_text(results: dict[str, Any]) -> str:
    """The human-readable ``evaluation_results.txt``."""
    lines = [
        f"target  {results['target']}",
        f"draft   {results['draft']}",
        f"prompts {results['prompts']} ({results['num_prompts']} prompts, max_new_tokens {results['max_new_tokens']})",
        f"device  {results['device']}, dtype {results['dtype']}, batch size 1",
        "",
        f"{'setting':<28} {'accept len':>10} {'tok/s':>9} {'target tok/s':>12} {'speedup':>8} "
        f"{'draft s':>8} {'target s':>9}",
    ]
    for s in results["settings"]:
        base = s.get("target_only") or {}
        lines.append(
            f"{s['name']:<28} {_fmt(s['acceptance_length']):>10} {_fmt(s['tokens_per_second'], 1):>9} "
            f"{_fmt(base.get('tokens_per_second'), 1):>12} {_fmt(s.get('speedup'), 2):>8} "
            f"{_fmt(s['draft_seconds'], 2):>8} {_fmt(s['target_seconds'], 2):>9}"
        )
    lines.append("")
    lines.append("acceptance rate per depth (given the previous depth was accepted):")
    for s in results["settings"]:
        rates = " ".join(_fmt(r, 2) for r in s["acceptance_rate_per_depth"])
        lines.append(f"  {s['name']:<26} {rates}")
    agreement = [
        (s["name"], s["greedy_agreement"]) for s in results["settings"] if s.get("greedy_agreement")
    ]
    if agreement:
        lines.append("")
        lines.append("greedy output vs target-only greedy:")
        for name, a in agreement:
            where = ", ".join(str(d["first_divergence"]) for d in a["diverged"][:10])
            more = " ..." if len(a["diverged"]) > 10 else ""
            lines.append(
                f"  {name:<26} identical {a['identical']}/{a['num_prompts']}"
                + (f"; first divergence at tokens {where}{more}" if a["diverged"] else "")
            )
    proxy = results.get("offline_proxy")
    if proxy:
        lines.append("")
        lines.append(
            f"offline proxy ({proxy['store']}, {proxy['num_samples']} samples, teacher {proxy['teacher']}):"
        )
        lines.append(
            "  TTT accuracy per depth: " + " ".join(_fmt(a, 3) for a in proxy["accuracy_per_depth"])
        )
        for name, value in proxy.get("predicted_acceptance_length", {}).items():
            real = next(
                (s["acceptance_length"] for s in results["settings"] if s["name"] == name), None
            )
            lines.append(f"  {name:<26} proxy {_fmt(value)} vs measured {_fmt(real)}")
    return "\n".join(lines) + "\n"
