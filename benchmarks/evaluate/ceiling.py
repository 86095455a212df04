"""The acceptance ceiling of the reference draft's architecture on the reference target (issue 28):
how far a draft that has seen exactly the contexts it is judged on gets, beside the shipped draft
on the same prompts.

The issue's ratio aim (>= 1.3x the raw-data draft) was missed at 1.09x; the issue asks, if the
target cannot allow it, for the measured ceiling: how often the target's greedy token is
predictable from its own features. Measured here, in stages over one work folder:

1. ``probe``: prompts no draft was trained on, built by the project's prompt builder
   (``pipelines.generate.source_prompts``: reserved files, ``transformers`` and evaluation
   overlaps already skipped). The builder orders files by a hash of their path and
   ``--max-files 4000`` keeps the first 4,000; the shipped draft used the first ~1,400 of those.
   The probe takes the last ``--num-prompts`` chat prompts of the whole ordering (the evaluation
   prompts' kind: "continue this file" chats), past the first ``--skip-files`` files, and none
   whose file is in ``../shared/data/draft_train.jsonl`` (the bundled slice's source).
2. ``generate``: the target's greedy answers (``hsstore generate``, float32, in process,
   ``--answer-tokens`` new tokens, stopping at the evaluation's stop ids only), so every context
   the decode at ``--max-new-tokens`` meets is in the data.
3. ``extract``: ``hsstore extract`` of those answers (the reference recipe, in process).
   ``contexts``: whether the store holds what the decode meets: each prompt's evaluation ids, then
   the target's greedy tokens from a batch-1 float32 ``generate`` (re-tokenizing the answer text
   can split a token differently).
4. ``train``: the shipped draft fine-tuned (``init_from``; its draft vocabulary kept) on the probe
   store for ``--train-steps`` steps of ``--token-budget`` rows (default 2,048, the extraction's
   ``max_length``: ~15 steps an epoch, ~3 s each on 2 cores); its metrics give the per-depth
   training accuracy of each epoch (every sample once), to see it stop rising. ``--train-device
   cuda`` runs ``extract`` and ``train`` on a GPU (``tools/gpu_reference_draft.sh raw-ceiling``).
5. ``decode``: acceptance length of the fine-tuned ("ceiling") and the shipped draft on the probe
   prompts: a chain of 5 and the tree 8/5/31 at T=0, float32, the ladder's settings
   (``benchmarks.evaluate.acceptance``). One process per draft and setting (``--drafts``,
   ``--settings``) so that they can run side by side.
6. ``accuracy``: per-depth accuracy of both drafts on the probe store (the offline proxy, the same
   code for both), and how many of the answers' tokens the draft vocabulary holds at all.

``--report`` merges the stages' files into ``--out``'s ``acceptance_ceiling`` key (the other keys
are kept as they are)::

    python -m benchmarks.bench_evaluate ceiling --work /tmp/ceiling                    # every stage
    python -m benchmarks.bench_evaluate ceiling --work /tmp/ceiling --stages decode --drafts ceiling --settings tree_t0
    python -m benchmarks.bench_evaluate ceiling --work /tmp/ceiling --report
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, machine_info, run_python_module
from benchmarks.evaluate.acceptance import SETTINGS, acceptance_lengths, heldout_accuracy

STAGES = ("probe", "generate", "extract", "contexts", "train", "decode", "accuracy")
DRAFTS = ("ceiling", "shipped", "raw")  # raw: a raw-data draft (--raw-draft), when given
T0_SETTINGS = [s for s in SETTINGS if "temperature" not in s]  # chain5_t0, tree_t0
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def hsstore_command(args: list[str], log: Path) -> list[str]:
    """Run ``hsstore ARGS`` (this checkout's CLI) with its output in ``log``; the command as run."""
    done = run_python_module("pipelines.cli", args, log=log)
    if done.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise RuntimeError(f"hsstore {args[0]} exited with {done.returncode} (log {log}):\n{tail}")
    return ["hsstore", *args]


def build_probe(args: argparse.Namespace) -> dict[str, Any]:
    """The probe prompts (``probe.jsonl``) and their description."""
    from pipelines.generate import source_prompts as sp

    eval_files = [p for p in (SHARED_DATA / "eval_prompts.jsonl", REPO_ROOT / "examples" / "data" / "eval_prompts.jsonl") if p.exists()]
    roots = [sp.SourceRoot(args.source_root, args.source_root)] if args.source_root else sp.installed_roots()
    records, summary = sp.build_prompts(roots, sp.read_reserved(args.reserved), eval_files, sp.BuildOptions())
    trained_paths: set[str] = set()
    for path in args.exclude_sources:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                trained_paths.add(sp.source_path(json.loads(line)["id"]))
    # A file gives at most one record (one window), in the files' order: record i comes from a
    # file at position >= i, so every record past skip_files is past the first skip_files files.
    chosen: list[tuple[int, dict[str, Any]]] = []
    for index in range(len(records) - 1, args.skip_files - 1, -1):
        record = records[index]
        if "messages" in record and sp.source_path(record["id"]) not in trained_paths:
            chosen.append((index, record))
        if len(chosen) == args.num_prompts:
            break
    if len(chosen) < args.num_prompts:
        raise SystemExit(f"only {len(chosen)} chat prompts past the first {args.skip_files} files")
    chosen.reverse()
    probe = args.work / "probe.jsonl"
    probe.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for _, r in chosen), encoding="utf-8")
    indices = [i for i, _ in chosen]
    return {
        "prompts": len(chosen),
        "kind": "chat 'continue this Python file' prompts (system + user), as examples/data/eval_prompts.jsonl",
        "builder": "pipelines.generate.source_prompts, default options (reserved files, transformers, eval overlaps, copies and tests skipped)",
        "sources": str(args.source_root) if args.source_root else "the installed Python's standard library and site-packages",
        "builder_records": len(records),
        "builder_skipped": dict(sorted(summary.skipped.items())),
        "record_positions": [min(indices), max(indices)],
        "skip_files": args.skip_files,
        "excluded_trained_sources": [str(p) for p in args.exclude_sources],
        "prompt_chars_mean": round(sum(len(r["messages"][-1]["content"]) for _, r in chosen) / len(chosen), 1),
        "ids": [r["id"] for _, r in chosen],
    }


def stage_generate(args: argparse.Namespace) -> dict[str, Any]:
    output = args.work / "generated"
    command = hsstore_command(
        [
            "generate", "recipes/reference/generate.yaml",
            "--set", f"data=[{args.work / 'probe.jsonl'}]", "--set", f"output={output}",
            "--set", f"sampling.max_new_tokens={args.answer_tokens}",
            # The evaluation stops at the target's EOS (2) only; <|endoftext|> (0) does not end its decode.
            "--set", "sampling.stop_token_ids=[]",
            "--set", "model.dtype=float32", "--set", "model.device=cpu", "--set", "executor=local",
        ],
        args.work / "generate.log",
    )
    manifest = json.loads((output / "generation.json").read_text())
    answers = [json.loads(line) for shard in sorted((output / "shards").glob("*.jsonl")) for line in shard.read_text().splitlines() if line.strip()]
    new_tokens = [a["generation"]["num_new_tokens"] for a in answers]
    return {
        "command": command,
        "answers": len(answers),
        "complete": manifest.get("complete"),
        "truncated": sum(bool(a["generation"]["truncated"]) for a in answers),
        "new_tokens_total": sum(new_tokens),
        "new_tokens_min": min(new_tokens) if new_tokens else 0,
        # An answer that is the stop token alone: the decode of that prompt makes no verification step.
        "empty_answers": sum(n == 0 for n in new_tokens),
    }


def stage_extract(args: argparse.Namespace) -> dict[str, Any]:
    store = args.work / "store"
    command = hsstore_command(
        [
            "extract", "recipes/reference/extract.yaml", "--set", f"data=[{args.work / 'generated'}]",
            "--set", f"store={store}", "--set", "executor=local",
            "--set", "model.dtype=float32", "--set", f"model.device={args.train_device}",
        ],
        args.work / "extract.log",
    )
    import hsstore

    opened = hsstore.open_store(str(store))
    loss_tokens = sum(int(sum(m)) for m in opened.samples.column("loss_mask").to_pylist()) if "loss_mask" in opened.samples.column_names else None
    return {"command": command, "samples": opened.num_samples, "tokens": opened.num_tokens, "loss_tokens": loss_tokens}


def stage_contexts(args: argparse.Namespace) -> dict[str, Any]:
    """Whether the store holds the contexts the decode meets: per probe prompt, the evaluation's
    prompt ids followed by the target's greedy tokens (batch 1, float32, ``--max-new-tokens``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hsstore
    from pipelines.evaluate.decoding import eos_token_ids
    from pipelines.evaluate.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    table = hsstore.open_store(str(args.work / "store")).samples
    stored = dict(zip(table.column("source_id").to_pylist(), table.column("input_ids").to_pylist(), strict=True))
    prefix_equal, greedy_equal, diverged = 0, 0, []
    for prompt in load_prompts(str(args.work / "probe.jsonl"), tokenizer, args.num_prompts):
        ids, length = stored[prompt.id], len(prompt.input_ids)
        prefix_equal += ids[:length] == prompt.input_ids
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt.input_ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                eos_token_id=sorted(eos_token_ids(model)), pad_token_id=0,
            )
        greedy = out[0, length:].tolist()
        answer = ids[length : length + len(greedy)]
        if answer == greedy:
            greedy_equal += 1
        else:
            first = next((i for i, (a, b) in enumerate(zip(answer, greedy, strict=False)) if a != b), min(len(answer), len(greedy)))
            diverged.append({"id": prompt.id, "first_difference_at": first})
    return {"prompt_ids_equal": prefix_equal, "greedy_tokens_equal": greedy_equal, "diverged": diverged}


def stage_train(args: argparse.Namespace) -> dict[str, Any]:
    command = hsstore_command(
        [
            "train", "recipes/reference/train-reference-draft.yaml",
            "--set", f"store={args.work / 'store'}", "--set", f"output_dir={args.work / 'draft-ceiling'}",
            "--set", f"init_from={args.shipped}", "--set", f"max_steps={args.train_steps}",
            "--set", f"optimizer.lr={args.lr}", "--set", "schedule.warmup_steps=5",
            "--set", "schedule.epochs=100000",
            "--set", f"loader.token_budget={args.token_budget}",
            "--set", f"device={args.train_device}", "--set", "log_every=1", "--set", f"checkpoint_every={args.train_steps}",
        ],
        args.work / "train.log",
    )
    return {"command": command, **training_curve(args.work / "draft-ceiling" / "metrics.jsonl")}


def training_curve(metrics: Path) -> dict[str, Any]:
    """Steps, and the per-depth training accuracy of each epoch (its steps' matches over its
    positions: every sample counted once), the run's tokens/s."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step" in r and "acc" in r]
    if not steps:
        return {"steps": 0}
    correct: dict[int, list[float]] = {}
    counted: dict[int, list[int]] = {}
    for r in steps:
        c = correct.setdefault(r["epoch"], [0.0] * len(r["acc"]))
        n = counted.setdefault(r["epoch"], [0] * len(r["acc"]))
        for depth, (acc, positions) in enumerate(zip(r["acc"], r["positions"], strict=True)):
            c[depth] += acc * positions
            n[depth] += positions
    per_epoch = {str(e): [round(c / max(n, 1), 4) for c, n in zip(correct[e], counted[e], strict=True)] for e in sorted(correct)}
    return {
        "steps": steps[-1]["step"],
        "epochs": len(per_epoch),
        "final_loss": steps[-1]["loss"],
        "train_acc_per_depth_by_epoch": per_epoch,
        "positions_by_epoch": {str(e): counted[e][0] for e in sorted(counted)},  # depth 0's; a short last epoch is partial
        "tokens_per_s": round(sum(r["tokens"] for r in steps) / max(sum(r["wall_s"] for r in steps), 1e-9), 1),
    }


def draft_path(args: argparse.Namespace, name: str) -> Path:
    if name == "shipped":
        return args.shipped
    if name == "raw":
        if args.raw_draft is None:
            raise SystemExit("--drafts raw needs --raw-draft PATH (a draft trained on the raw records)")
        return args.raw_draft
    return args.ceiling_draft or args.work / "draft-ceiling" / "checkpoints" / "final"


def drafts_to_measure(args: argparse.Namespace) -> list[str]:
    """The drafts measured unless ``--drafts`` names others: ceiling and shipped, and raw when it is given."""
    return [name for name in DRAFTS if name != "raw" or args.raw_draft is not None]


def stage_decode(args: argparse.Namespace) -> None:
    chosen = [s for s in T0_SETTINGS if s["name"] in args.settings.split(",")]
    for name in args.drafts.split(",") if args.drafts else drafts_to_measure(args):
        for setting in chosen:
            start = time.perf_counter()
            lengths = acceptance_lengths(
                draft_path(args, name), target=args.target, prompts=args.work / "probe.jsonl",
                out=args.work / f"eval-{name}-{setting['name']}", limit=args.num_prompts,
                max_new_tokens=args.max_new_tokens, device="cpu", settings=[setting],
            )
            result = {"draft": name, **lengths, "decode_seconds": round(time.perf_counter() - start, 1)}
            (args.work / f"decode-{name}.{setting['name']}.json").write_text(json.dumps(result, indent=2) + "\n")
            print(json.dumps(result), flush=True)


def vocab_coverage(draft: Path, store: Path, target: Path) -> float:
    """The share of the store's loss-masked tokens (the answers) that ``draft``'s vocabulary holds."""
    import torch

    import hsstore
    from pipelines.models.checkpoint import load_draft
    from pipelines.train.target_heads import load_target_heads
    from pipelines.train.vocab import count_loss_tokens_in_table

    embed = load_target_heads(str(target)).embed_tokens_VH.to(torch.float32)
    model = load_draft(draft, device=torch.device("cpu"), dtype=torch.float32, embed_tokens=embed)
    counts = torch.as_tensor(count_loss_tokens_in_table(hsstore.open_store(str(store)).samples, embed.shape[0]))
    return round(float(counts[model.t2d.cpu().bool()].sum()) / float(counts.sum()), 4)


def stage_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store = args.work / "store"
    for name in drafts_to_measure(args):
        draft = draft_path(args, name)
        accuracy = heldout_accuracy(draft, store=store, target=args.target, device="cpu", max_samples=args.num_prompts)
        out[name] = {
            "accuracy_per_depth": [round(a, 4) if a is not None else None for a in accuracy],
            "vocab_coverage": vocab_coverage(draft, store, args.target),
        }
    return out


def report(args: argparse.Namespace) -> dict[str, Any]:
    """``acceptance_ceiling``: every stage's file merged, and the ratios."""
    stages = json.loads((args.work / "stages.json").read_text())
    al: dict[str, dict[str, float]] = {name: {} for name in DRAFTS}
    seconds: dict[str, dict[str, float]] = {name: {} for name in DRAFTS}
    for path in sorted(args.work.glob("decode-*.json")):
        result = json.loads(path.read_text())
        name = result.pop("draft")
        seconds[name][path.name.split(".")[1]] = result.pop("decode_seconds")
        al[name].update(result)
    ceiling: dict[str, Any] = {
        "what": "acceptance length of a draft of the shipped architecture fine-tuned on the probe prompts' own "
        "features (it has seen every context it is judged on) beside the shipped draft (and the raw-data draft, "
        "when given) on the same prompts",
        "probe": stages.get("probe"),
        "steps": {k: stages[k] for k in ("generate", "extract", "contexts", "train") if k in stages},
        "acceptance_length": al,
        "decode_seconds": seconds,
        "accuracy_on_probe_store": stages.get("accuracy"),
        "eval": {"limit": args.num_prompts, "max_new_tokens": args.max_new_tokens, "settings": T0_SETTINGS, "dtype": "float32"},
    }
    if args.ceiling_draft is not None and (args.ceiling_draft / "metrics.jsonl").exists():
        # trained elsewhere (e.g. the GPU stage of tools/gpu_reference_draft.sh): its curve from the metrics beside it
        ceiling["steps"]["train"] = {"draft": str(args.ceiling_draft), **training_curve(args.ceiling_draft / "metrics.jsonl")}
    measured: dict[str, float] = {}
    for key in ("al_chain5_t0", "al_tree_t0"):
        for over in ("shipped", "raw"):  # ceiling_over_raw: the 1.3x aim measured on one prompt set
            if key in al["ceiling"] and key in al[over]:
                measured[f"ceiling_over_{over}_{key.removeprefix('al_')}"] = round(al["ceiling"][key] / al[over][key], 3)
        if key in al["shipped"] and key in al["raw"]:
            measured[f"shipped_over_raw_{key.removeprefix('al_')}"] = round(al["shipped"][key] / al["raw"][key], 3)
    ceiling["measured_ratios"] = measured
    if args.out.exists():
        results = json.loads(args.out.read_text())
        ladder = results.get("ladder", {})
        estimate: dict[str, Any] = {}
        for key in ("al_chain5_t0", "al_tree_t0"):
            raw = ladder.get("raw", {}).get(key)
            shipped_eval = ladder.get(results.get("shipped_rung", "greedy"), {}).get(key)
            ratio = measured.get(f"ceiling_over_shipped_{key.removeprefix('al_')}")
            if raw and shipped_eval and ratio:
                # The ceiling is measured on the probe; scaled by the shipped draft's eval AL it is an
                # estimate of the ceiling on the evaluation prompts, which is set against the raw draft.
                estimate[key.removeprefix("al_")] = {
                    "raw_on_eval": round(raw, 3),
                    "aim_1_3x_raw": round(1.3 * raw, 3),
                    "ceiling_on_eval_estimate": round(shipped_eval * ratio, 3),
                    "over_raw_estimate": round(shipped_eval * ratio / raw, 3),
                    "ceiling_on_probe_over_raw_on_eval": round(al["ceiling"][key] / raw, 3),
                }
        ceiling["versus_raw_data_draft"] = estimate
    ceiling["notes"] = [
        "measured: the drafts' acceptance lengths on the probe prompts, decoded in this run, and their ratios "
        "(ceiling_over_raw: how far above the raw-data draft any draft of this architecture gets on these prompts)",
        "estimate: ceiling_on_eval_estimate = the shipped draft's AL on the evaluation prompts (the ladder) x the "
        "measured probe ratio, assuming the ratio carries over between the two prompt sets; over_raw_estimate = "
        "that / the raw-data draft's AL on the evaluation prompts",
        "ceiling_on_probe_over_raw_on_eval divides numbers from two prompt sets (the shipped draft reaches more on "
        "the probe prompts than on the evaluation prompts)",
        "accuracy_per_depth counts the positions whose target token the draft vocabulary holds (the trainer's "
        "metric); vocab_coverage is the share of answer tokens it holds at all: the rest no draft of that vocabulary "
        "can propose",
    ]
    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers")}
    ceiling["machine"] = {k: v for k, v in machine_info().items() if k in ("date", "cpu", "nproc", "python")} | versions
    if args.machine_note:
        ceiling["machine"]["note"] = args.machine_note
    return ceiling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the work folder (probe, data, store, drafts, results)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to run, in order")
    parser.add_argument("--report", action="store_true", help="merge the stages' results into --out")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--skip-files", type=int, default=4000, help="probe prompts come from past this many files")
    parser.add_argument(
        "--exclude-sources", type=Path, nargs="*", default=[p for p in (SHARED_DATA / "draft_train.jsonl",
                                                                        REPO_ROOT / "examples" / "data" / "draft_train_slice.jsonl") if p.exists()],
        help="records whose files never become probe prompts (the drafts' training sources)",
    )
    parser.add_argument("--reserved", type=Path, default=SHARED_DATA / "reserved_sources.sha256")
    parser.add_argument("--source-root", type=Path, default=None, help="build the probe from this folder's .py files "
                        "instead of the installed Python's (tests)")
    parser.add_argument("--answer-tokens", type=int, default=160, help="new tokens per greedy answer (>= --max-new-tokens)")
    parser.add_argument("--train-steps", type=int, default=450)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per row (the extraction's max_length)")
    parser.add_argument("--drafts", default=None, help="comma-separated drafts to decode (default: ceiling, shipped, "
                        "and raw when --raw-draft is given)")
    parser.add_argument("--settings", default=",".join(s["name"] for s in T0_SETTINGS), help="comma-separated settings")
    parser.add_argument("--shipped", type=Path, default=REPO_ROOT / "examples" / "reference-draft")
    parser.add_argument("--raw-draft", type=Path, default=None, help="a draft trained on the raw records (the "
                        "ladder's raw rung), decoded beside the others: the ceiling over it is the 1.3x aim measured")
    parser.add_argument("--ceiling-draft", type=Path, default=None, help="the ceiling draft, if trained elsewhere "
                        "(default: the train stage's, WORK/draft-ceiling/checkpoints/final)")
    parser.add_argument("--train-device", default="cpu", help="where the extract and train stages run (the answers "
                        "and the decode stay float32 on the CPU, as the evaluation runs)")
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "examples" / "reference-target")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "reference-draft.json")
    parser.add_argument("--machine-note", default=None, help="said in the report's machine entry (e.g. its load)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)

    if args.report:
        ceiling = report(args)
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results["acceptance_ceiling"] = ceiling
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(ceiling, indent=2))
        return 0

    record = args.work / "stages.json"
    stages: dict[str, Any] = json.loads(record.read_text()) if record.exists() else {}
    runners = {"probe": build_probe, "generate": stage_generate, "extract": stage_extract, "contexts": stage_contexts,
               "train": stage_train,
               "accuracy": stage_accuracy}
    for stage in args.stages.split(","):
        if stage not in STAGES:
            raise SystemExit(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
        start = time.perf_counter()
        if stage == "decode":
            stage_decode(args)
            continue
        stages[stage] = runners[stage](args) | {"seconds": round(time.perf_counter() - start, 1)}
        record.write_text(json.dumps(stages, indent=2) + "\n")  # after each stage: a later one may fail
        print(f"{stage}: {json.dumps({k: v for k, v in stages[stage].items() if k != 'ids'})}", flush=True)
    return 0
