"""Issue 13 / 16 on a GPU box: `hsstore extract` through Ray (1 and 2 actors, bf16 and fp8) and a
target split over 2 GPUs, against a bare forward of the same model on the same batches.

One command, one run (``run``), in steps that each start their own process so that every GPU run
starts from a clean device:

1. ``prepare``: the Qwen3-8B shape with random bf16 weights (benchmarks/bench_extract.py's
   builder) saved as a model directory, with a word-level tokenizer (``t<id>`` is token ``id``, so
   a record of N words is N tokens; checked) and text records of ``--min-length``..``--max-length``
   tokens;
2. a disk write test (``--disk-gib`` written and fsynced): the disk's GB/s;
3. ``bare``: the model on one GPU, ``model.model(input_ids)`` with no mask over exactly the batches
   the extraction plans (the same planning code: length-sorted windows, the same token budget),
   warmed up on two batches first;
4. ``hsstore extract`` through Ray: bf16 and fp8_e4m3 (aux and final) with 1 actor, then with 2
   (one GPU each); each store is deleted after its run (an 8B bf16 store is 32 KiB per token),
   but the 1-GPU bf16 one, kept for step 6;
5. the split target: one actor owning 2 GPUs (``ray.num_gpus_per_worker=2``) over the first
   ``--split-records`` records;
6. ``compare``: the split store against one GPU's features on the same batches (the extraction's
   capture code, in process) and against the 1-GPU bf16 store.

The JSON files are rewritten after every step, so a run cut short keeps what it measured; no step
starts after ``--deadline-s``.

``--sequence bare,fp8-1,bare,fp8-1-shm,bare`` runs steps in exactly that order instead (after
``prepare`` and the disk test): the bare forward between the extraction runs, so that each run is
compared with the bare passes on either side of it (the GPU's clocks drift by 1-1.5% over a call;
a single bare pass before the runs cannot resolve 97% from 95%). A ``-shm`` run writes its store
under /dev/shm (memory, no disk): beside the same run on disk it shows what the disk's writes cost
the forwards. The JSON's ``sequence`` lists every step; ``sequence_ratios`` each run's ratios.

Tokens/s are the real (unpadded) tokens over the extraction's own timer (the summary's
``extract_seconds``: from the first unit handed out to the last commit, actors already started and
models loaded); the bare forward's are the same tokens over its forward time.

    # GPU box (2 GPUs), from the repository root, after `bash .gpu/setup.sh`:
    PYTHONPATH=/tmp/site:$PWD python -m benchmarks.bench_extract ray run --out $OUT
    # CPU smoke (tiny model, in-process executor, no split):
    python -m benchmarks.bench_extract ray run --shape small --device cpu --executor local \\
        --tokens 6000 --min-length 64 --max-length 256 --max-length-cap 512 --token-budget 1024 \\
        --unit-tokens 2048 --disk-gib 0.01 --out /tmp/out

Writes ``extract-h200.json`` (issue 13's keys) and ``split-target.json`` (issue 16's
``split_target``) under ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, run_python_module

AUX_LAYER_IDS = {"qwen3-8b": [2, 18, 33], "small": [1, 2, 3]}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- step 1: model, tokenizer, data --------------------------------------------------------------


def prepare(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.bench_extract import build_model

    work = Path(args.work)
    model_dir = work / "target"
    if not (model_dir / "config.json").exists():
        device = torch.device(args.device)
        model = build_model(args.shape, torch.bfloat16, device)
        # Shards of at most 4 GB, as the Qwen3-8B checkpoint ships (5 files): the lineage hashes
        # them in parallel, and the loaders read what a user's target gives them.
        model.save_pretrained(model_dir, max_shard_size="4GB")
        vocab_size = model.config.vocab_size
        del model
        write_word_tokenizer(model_dir, vocab_size)
    total = write_records(model_dir, work / "records.jsonl", args.tokens, args.min_length, args.max_length)
    log(f"prepared {model_dir} and {total:,} tokens of records")
    print(json.dumps({"num_tokens": total}))


def write_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer that maps the word ``t<id>`` to ``id`` (records are written in it)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # transformers versions that name only the backend class
        from transformers import TokenizersBackend as PreTrainedTokenizerFast

    # Specials must not be words' prefixes: a special token is matched anywhere in the text.
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    words = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>").save_pretrained(model_dir)


def write_records(model_dir: Path, path: Path, tokens: int, min_length: int, max_length: int) -> int:
    """Text records of random words, ``tokens`` in all, each of min..max_length tokens; checks
    first that the target's tokenizer maps them back to their ids. Returns the token count."""
    import numpy as np
    from transformers import AutoTokenizer

    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    probe = " ".join(f"t{i}" for i in (3, 100, 1000, vocab_size - 1))
    if AutoTokenizer.from_pretrained(model_dir)(probe)["input_ids"] != [3, 100, 1000, vocab_size - 1]:
        raise SystemExit(f"{model_dir}: the word-level tokenizer does not map t<id> to id")
    rng = np.random.default_rng(0)
    total = 0
    with open(path, "w") as handle:
        while total < tokens:
            length = int(rng.integers(min_length, max_length + 1))
            ids = rng.integers(3, vocab_size, length)
            handle.write(json.dumps({"id": f"r{total}", "text": " ".join(f"t{i}" for i in ids)}) + "\n")
            total += length
    return total


def disk_gb_per_s(directory: Path, gib: float) -> float:
    """Write ``gib`` GiB in 64 MiB blocks and fsync: what the store's disk takes."""
    path = directory / "disk-test.bin"
    block = os.urandom(64 << 20)
    count = max(1, int(gib * 16))
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(count):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return count * len(block) / seconds / 1e9


# --- the recipe every extraction run uses ----------------------------------------------------------


def write_recipe(
    args: argparse.Namespace, name: str, *, codec: str, workers: int, gpus_per_worker: int, limit: int | None,
    executor: str | None = None,
) -> Path:
    import yaml

    work = Path(args.work)
    recipe: dict[str, Any] = {
        "target": str(work / "target"),
        "data": [str(work / "records.jsonl")],
        "store": str(store_path(args, name)),
        "limit": limit,
        "executor": executor or args.executor,
        # model.compile by name (a "-compiled" run), never "auto": the runs named as before stay the
        # eager extraction they measured before auto compiled on CUDA. "-compiled" waits for the
        # compile before the first unit (the steady state); "-compiled-background" is the default
        # start (eager units while the layers compile).
        "model": {"dtype": "bfloat16", "device": "auto" if args.device == "cuda" else "cpu", "compile": is_compiled(name),
                  "compile_backend": args.compile_backend, "compile_in_background": "background" in name.split("-")[2:],
                  "weights_loader": "transformers" if "hfload" in name.split("-")[2:] else "auto"},
        "capture": {"aux_layer_ids": AUX_LAYER_IDS[args.shape]},
        "codecs": {
            "aux_hidden_states": {"codec": codec},
            "final_hidden_state": {"codec": codec},
        },
        # Issue 13's settings; everything else (the attention mask, the sort windows) the defaults.
        "batching": {"max_length": args.max_length_cap, "token_budget": args.token_budget},
        "units": {"max_tokens": args.unit_tokens},
        "planning": {"num_workers": args.planning_workers},
        "ray": {"num_workers": workers, "num_gpus_per_worker": gpus_per_worker, "num_cpus_per_worker": args.cpus_per_worker},
    }
    if is_traced(name):
        recipe["profiler"] = {"dir": str(Path(args.out) / "traces"), "batches": args.trace_batches}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


SHM_STORES = Path("/dev/shm/hsstore-bench-stores")


def store_path(args: argparse.Namespace, name: str) -> Path:
    """Where run ``name`` writes its store: the work folder's disk, or memory for a ``-shm`` run."""
    return SHM_STORES / name if name.endswith("-shm") else Path(args.work) / "stores" / name


def extract(args: argparse.Namespace, name: str, env: dict[str, str] | None = None, **settings: Any) -> dict[str, Any]:
    """``hsstore extract`` of run ``name`` in its own process (``env``: its environment, default
    this one's; ``run_python_module``); its summary, with the process's seconds and the store's GB/s
    written."""
    recipe = write_recipe(args, name, **settings)
    shutil.rmtree(store_path(args, name), ignore_errors=True)
    log(f"extract {name} ({settings})")
    start = time.perf_counter()
    done = run_python_module("pipelines.cli", ["extract", str(recipe), "--json", "--no-progress"], env)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"extract {name} failed ({done.returncode})")
    summary = last_json_object(done.stdout)
    summary["process_seconds"] = time.perf_counter() - start
    summary["write_gb_per_s"] = summary["store_bytes"] / summary["extract_seconds"] / 1e9
    log(f"  {summary['tokens_per_second']:,.0f} tok/s, padding {100 * summary['padding_waste']:.2f}%, "
        f"writer busy {100 * summary['writer_busy_fraction']:.0f}%, {summary['write_gb_per_s']:.2f} GB/s written, "
        f"forwards {100 * summary['compute_busy_fraction']:.1f}% of {summary['extract_seconds']:.1f} s "
        f"(GPU: {summary.get('gpu_forward_seconds', 0):.2f} s in forwards, {summary.get('gpu_between_seconds', 0):.2f} s "
        f"between, first forward after {summary.get('gpu_head_seconds', 0):.2f} s, last done {summary.get('gpu_tail_seconds', 0):.2f} s "
        f"before the end) (head {summary['head_seconds']:.2f} s, tail {summary['tail_seconds']:.2f} s, of it "
        f"{summary.get('tail_after_landed_seconds', 0):.2f} s after the last features landed, "
        f"waiting for host buffers {summary['pool_wait_seconds']:.2f} s), "
        f"{summary['process_seconds']:.0f} s in all")
    return summary


def last_json_object(text: str) -> dict[str, Any]:
    """The summary `hsstore extract --json` prints (indented: a line "{" to a line "}"), whatever
    else (Ray's log lines) shares its stdout."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return json.loads("\n".join(lines[start : end + 1]))


def step(args: argparse.Namespace, name: str, *extra: str, mode: str = "ray") -> dict[str, Any]:
    """Run a step of this script (of bench_extract's ``mode``) in its own process (in this one
    where the smoke tests say so: ``benchmarks.common.run_python_module``); it prints one JSON line
    last."""
    argv = [mode, name, "--work", args.work, "--shape", args.shape, "--device", args.device,
            "--token-budget", str(args.token_budget), "--unit-tokens", str(args.unit_tokens),
            "--max-length-cap", str(args.max_length_cap), "--split-records", str(args.split_records),
            "--compare-samples", str(args.compare_samples), *extra]
    done = run_python_module("benchmarks.bench_extract", argv)
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode != 0:
        raise SystemExit(f"step {name} failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- step 4: bare forward, and one-GPU features of the split run's first batches -----------------


def planned_units(args: argparse.Namespace, limit: int | None) -> tuple[list[Any], int]:
    """The units `hsstore extract` plans for these records (its own streaming planner)."""
    from pipelines.extract.planner import StreamPlanner
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.extract.tokenizer_pool import make_sample_tokenizer
    from pipelines.recipe import load_recipe

    recipe = load_recipe(ExtractRecipe, str(write_recipe(args, "plan", codec="bf16", workers=1, gpus_per_worker=1, limit=limit)), [])
    tokenizer = make_sample_tokenizer(recipe, recipe.target)
    pad = tokenizer.tokenizer.pad_token_id
    units = [unit for window in StreamPlanner(recipe, tokenizer, recipe.target).windows() for unit in window.units]
    return units, int(pad if pad is not None else 0)


def bare(args: argparse.Namespace) -> None:
    import torch

    from pipelines.extract.batching import collate, padding_waste, plan_batches
    from pipelines.extract.gpu_timing import GpuTimeline
    from pipelines.extract.target import load_target

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    model = load_target(str(Path(args.work) / "target"), dtype="bfloat16", device=device)
    units, pad = planned_units(args, None)
    batches = [(unit, b) for unit in units for b in plan_batches([len(r.input_ids) for r in unit.rows], args.token_budget, pad_to_multiple_of=8)]

    def forward(unit: Any, batch: Any) -> None:
        input_ids, _ = collate([r.input_ids for r in unit.rows], batch, pad)
        model.model(input_ids=torch.from_numpy(input_ids).to(device, non_blocking=True), use_cache=False)

    timeline = GpuTimeline(device)  # the worker's own timing of its forwards (nothing on a CPU)

    @torch.inference_mode()
    def timed() -> float:
        for unit, batch in batches[:2]:
            forward(unit, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for unit, batch in batches:
            with timeline.forward():
                forward(unit, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    # On a worker thread, as the extraction's forwards run: on a loaded CPU, torch's intra-op
    # threads behave differently on the main thread (bench_extract.py); on a GPU it makes no odds.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        seconds = pool.submit(timed).result()
    num_tokens = sum(b.num_tokens for _, b in batches)
    result: dict[str, Any] = {
        "bare_tokens_per_s": num_tokens / seconds,
        "bare_seconds": seconds,
        "num_tokens": num_tokens,
        "num_batches": len(batches),
        "padding_fraction": padding_waste([b for _, b in batches]),
    }
    if timeline.events:  # the GPU's time in the forwards and between them, as the extraction reports it
        result["gpu_forward_seconds"], result["gpu_between_seconds"] = timeline.seconds(None)
    log(f"bare: {result['bare_tokens_per_s']:,.0f} tok/s over {num_tokens:,} tokens, padding {100 * result['padding_fraction']:.2f}%")
    print(json.dumps(result))


def relative_error(actual: Any, expected: Any) -> float:
    """Largest per-token relative L2 error (tests/pipelines/extract/helpers.py's measure)."""
    actual_TD = actual.float().reshape(actual.shape[0], -1)
    expected_TD = expected.float().reshape(expected.shape[0], -1)
    error_T = (actual_TD - expected_TD).norm(dim=-1) / expected_TD.norm(dim=-1).clamp_min(1e-6)
    return float(error_T.max())


def same_batches_error(
    args: argparse.Namespace, name: str, limit: int | None, references: tuple[str, ...] = ("bfloat16",)
) -> tuple[dict[str, float], int]:
    """Run ``name``'s store against the same batches (its first unit, batch by batch as its
    worker ran them: the same planning, budget and padding) through the extraction's capture code
    on one device, eager, in this process, with the target in each of ``references`` (dtypes).

    Returns the largest per-token relative error of the aux and final states over at most
    ``--compare-samples`` samples, keyed ``store_vs_<dtype>`` and, with more than one reference,
    ``<first>_vs_<other>`` (e.g. ``bfloat16_vs_float32``: what bf16 itself costs, the yardstick
    for the store's error against float32), and how many samples were compared."""
    import numpy as np
    import torch

    import hsstore
    from pipelines.extract.batching import collate, plan_batches
    from pipelines.extract.capture import HiddenStateCapture
    from pipelines.extract.target import load_target

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    stored = hsstore.open_store(str(store_path(args, name)))
    index_of = {sid: i for i, sid in enumerate(stored.samples["sample_id"].to_pylist())}
    captures = {
        dtype: HiddenStateCapture(
            load_target(str(Path(args.work) / "target"), dtype=dtype, device=device), AUX_LAYER_IDS[args.shape],
            pass_attention_mask=False,
        )
        for dtype in references
    }
    units, pad = planned_units(args, limit)
    unit = units[0]
    worst: dict[str, float] = {}
    compared = 0

    def note(key: str, actual: Any, expected: Any) -> None:
        worst[key] = max(worst.get(key, 0.0), relative_error(actual, expected))

    for batch in plan_batches([len(r.input_ids) for r in unit.rows], args.token_budget, pad_to_multiple_of=8):
        if compared >= args.compare_samples:
            break
        input_ids, mask = collate([r.input_ids for r in unit.rows], batch, pad)
        valid = torch.from_numpy(np.flatnonzero(mask.reshape(-1))).to(device)
        inputs = (torch.from_numpy(input_ids).to(device), torch.from_numpy(mask).to(device), valid)
        features = {dtype: capture(*inputs) for dtype, capture in captures.items()}
        offset = 0
        for i in batch.indices:
            row = unit.rows[i]
            sample = stored.read_sample(index_of[row.sample_id])
            span = slice(offset, offset + len(row.input_ids))
            for feature in ("aux_hidden_states", "final_hidden_state"):
                ours = {dtype: f[feature][span].cpu() for dtype, f in features.items()}
                for dtype in references:
                    note(f"store_vs_{dtype}", sample[feature], ours[dtype])
                for dtype in references[1:]:
                    note(f"{references[0]}_vs_{dtype}", ours[references[0]], ours[dtype])
            offset += len(row.input_ids)
            compared += 1
    for capture in captures.values():
        capture.close()
    return worst, compared


def compare(args: argparse.Namespace) -> None:
    """The split store against one GPU: (a) the same batches (the split run's first unit, batch by
    batch as its worker ran it) through the extraction's capture code on one GPU; (b) the 1-GPU
    bf16 store, sample by sample (the same sample ids, batched differently, so bf16 rounding
    differs a little as well)."""
    import hsstore

    stores = Path(args.work) / "stores"
    errors, compared = same_batches_error(args, "split", args.split_records)
    worst = errors["store_vs_bfloat16"]
    split = hsstore.open_store(str(stores / "split"))
    split_ids = split.samples["sample_id"].to_pylist()
    result: dict[str, Any] = {"split_max_rel_err_same_batches": worst, "split_samples_compared": compared}
    log(f"split vs one GPU, same batches: max relative error {worst:.2e} over {compared} samples")
    if (stores / "bf16-1" / "manifest.json").exists():
        one = hsstore.open_store(str(stores / "bf16-1"))
        one_index = {sid: i for i, sid in enumerate(one.samples["sample_id"].to_pylist())}
        store_worst, store_compared = 0.0, 0
        for index, sample_id in enumerate(split_ids[: args.compare_samples]):
            a, b = split.read_sample(index), one.read_sample(one_index[sample_id])
            for name in ("aux_hidden_states", "final_hidden_state"):
                store_worst = max(store_worst, relative_error(a[name], b[name]))
            store_compared += 1
        result.update(split_max_rel_err_vs_store=store_worst, split_store_samples_compared=store_compared)
        log(f"split store vs 1-GPU store: max relative error {store_worst:.2e} over {store_compared} samples")
    print(json.dumps(result))


# --- the whole session ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    """Every step in turn; the JSON files are rewritten after each, so a run cut short keeps what it
    measured. A step that fails is logged and skipped; none starts after ``--deadline-s``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    state: dict[str, Any] = {"machine": machine_facts(args), "runs": {}, "bare": None, "bare_after": None, "disk": None,
                             "compared": {}}
    step(args, "prepare", "--tokens", str(args.tokens), "--min-length", str(args.min_length), "--max-length", str(args.max_length))
    state["disk"] = disk_gb_per_s(work, args.disk_gib)
    log(f"disk: {state['disk']:.2f} GB/s written (fsync)")
    one_gpu = 1 if args.device == "cuda" else 0
    split = args.device == "cuda" and args.split_gpus > 1

    def timed_out(name: str) -> bool:
        if time.time() - started > args.deadline_s:
            log(f"skipped {name}: past --deadline-s {args.deadline_s}")
            return True
        return False

    def attempt(name: str, action: Any) -> None:
        if timed_out(name):
            return
        try:
            action()
        except (SystemExit, Exception) as err:  # noqa: BLE001 - one failed step must not lose the others
            log(f"{name} failed: {err}")
        write_outputs(args, state, started)

    if args.sequence:
        run_sequence(args, state, attempt)
        shutil.rmtree(work / "stores", ignore_errors=True)
        shutil.rmtree(SHM_STORES, ignore_errors=True)
        write_outputs(args, state, started)
        print(sequence_table(state))
        return
    attempt("bare", lambda: state.update(bare=step(args, "bare")))
    # "-local": the same extraction in the driver's process (executor=local), to tell what Ray costs.
    plan = [("bf16-1", "bf16", 1), ("fp8-1", "fp8_e4m3", 1), ("bf16-1-local", "bf16", 1),
            ("fp8-1-local", "fp8_e4m3", 1), ("bf16-2", "bf16", 2), ("fp8-2", "fp8_e4m3", 2)]
    wanted = set(args.runs.split(","))
    for name, codec, workers in plan:
        if workers > args.gpus or name not in wanted:
            continue
        executor = "local" if name.endswith("-local") else None
        attempt(name, lambda name=name, codec=codec, workers=workers, executor=executor: state["runs"].__setitem__(
            name, extract(args, name, codec=codec, workers=workers, gpus_per_worker=one_gpu, limit=None,
                          executor=executor)))
        # bf16-1 is kept for the split comparison, if the disk holds it next to the next store
        # (an fp8 store is half its size; the split run's is small).
        written = state["runs"].get(name, {}).get("store_bytes", 0)  # the manifest's count
        keep = name == "bf16-1" and split and written and written // 2 + (8 << 30) < shutil.disk_usage(work).free
        if not keep:
            shutil.rmtree(work / "stores" / name, ignore_errors=True)
    if args.bare_after:
        # The bare forward again after the runs: the GPU's drift over the call (clocks, heat) shows
        # as the two bare figures' difference, and the runs are compared with their mean.
        attempt("bare-after", lambda: state.update(bare_after=step(args, "bare")))
    if split and "split" in wanted:
        attempt("split", lambda: state["runs"].__setitem__(
            "split", extract(args, "split", codec="bf16", workers=1, gpus_per_worker=args.split_gpus, limit=args.split_records)))
        if "split" in state["runs"]:
            attempt("compare", lambda: state.update(compared=step(args, "compare")))
    shutil.rmtree(work / "stores", ignore_errors=True)
    write_outputs(args, state, started)
    if state["bare"] is not None and state["runs"]:
        print(table(json.loads((out / "extract-h200.json").read_text()), state["runs"]))


def parse_run(name: str) -> tuple[str, int, str | None]:
    """``fp8-1-local-shm`` -> (codec, actors, executor): the run names of ``--runs``, plus ``-shm``,
    ``-trace`` (a torch.profiler trace of each worker's first batches, written under ``--out``:
    a diagnostic, left out of the ratios), ``-compiled`` (``model.compile: true``, ready once compiled)
    and ``-compiled-background`` (compiled in the background, the default start)."""
    parts = name.split("-")
    codec = {"bf16": "bf16", "fp8": "fp8_e4m3"}.get(parts[0])
    if codec is None or len(parts) < 2 or not parts[1].isdigit() or not set(parts[2:]) <= {"local", "shm", "trace", "compiled", "background"}:
        raise SystemExit(f"--sequence: unknown step {name!r} (bare, or e.g. bf16-1, fp8-1-shm, fp8-1-local, fp8-1-trace, "
                         "bf16-1-compiled)")
    return codec, int(parts[1]), "local" if "local" in parts[2:] else None


def is_traced(name: str) -> bool:
    return "trace" in name.split("-")[2:]


def is_compiled(name: str) -> bool:
    """A ``-compiled`` run: ``model.compile: true`` (every other run ``false``)."""
    return "compiled" in name.split("-")[2:]


def run_sequence(args: argparse.Namespace, state: dict[str, Any], attempt: Any) -> None:
    """The ``--sequence`` steps in order; each extraction run's store is deleted after it."""
    one_gpu = 1 if args.device == "cuda" else 0
    steps = args.sequence.split(",")
    for name in steps:  # every name checked before the first GPU step
        if name != "bare":
            parse_run(name)
    state["sequence"] = []
    for index, name in enumerate(steps):
        def do(index: int = index, name: str = name) -> None:
            if name == "bare":
                result = step(args, "bare")
            else:
                codec, workers, executor = parse_run(name)
                result = extract(args, name, codec=codec, workers=workers, gpus_per_worker=one_gpu, limit=None,
                                 executor=executor)
                shutil.rmtree(store_path(args, name), ignore_errors=True)
            state["sequence"].append({"index": index, "step": name, **result})
            if name == "bare" and state["bare"] is None:
                state["bare"] = result
        attempt(f"{name} (step {index})", do)


def sequence_ratios(state: dict[str, Any]) -> dict[str, list[float]]:
    """Each extraction run's tokens/s per GPU over the mean of the bare passes just before and
    after it (one of them where the other did not run), grouped by run name."""
    done = state.get("sequence") or []
    ratios: dict[str, list[float]] = {}
    for position, entry in enumerate(done):
        if entry["step"] == "bare" or is_traced(entry["step"]):  # a traced run's speed is no measurement
            continue
        neighbours = [e for e in (done[position - 1] if position else None,
                                  done[position + 1] if position + 1 < len(done) else None)
                      if e is not None and e["step"] == "bare"]
        if not neighbours:
            continue
        bare_tps = sum(e["bare_tokens_per_s"] for e in neighbours) / len(neighbours)
        workers = parse_run(entry["step"])[1]
        entry["vs_neighbouring_bare"] = entry["tokens_per_second"] / (workers * bare_tps)
        # The GPU's part: from the first forward to the last batch's features on the host, against
        # the bare forward's time for the same tokens (what the tail's host work does not touch).
        gpu_span = entry["extract_seconds"] - entry["head_seconds"] - entry.get("tail_after_landed_seconds", 0.0)
        entry["gpu_span_vs_bare"] = gpu_span / (entry["num_tokens_written"] / (workers * bare_tps))
        bare_gpu = [e["gpu_forward_seconds"] for e in neighbours if e.get("gpu_forward_seconds")]
        if entry.get("gpu_forward_seconds") and bare_gpu:  # the forwards' own GPU time, summed
            entry["gpu_forward_vs_bare"] = entry["gpu_forward_seconds"] / (workers * sum(bare_gpu) / len(bare_gpu))
        ratios.setdefault(entry["step"], []).append(entry["vs_neighbouring_bare"])
    return ratios


def fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def sequence_table(state: dict[str, Any]) -> str:
    lines = ["| step | tokens/s | vs neighbouring bare | first forward to last features landed, / bare s | "
             "tail s | of it after the last features landed | GPU in forwards / bare (bare: s) | GPU between forwards s | "
             "first forward on the GPU after s | last done before the end s | writer busy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in state.get("sequence") or []:
        if entry["step"] == "bare":
            lines.append(f"| bare | {entry['bare_tokens_per_s']:,.0f} | | | | | "
                         f"{fmt(entry.get('gpu_forward_seconds'), '.2f')} | {fmt(entry.get('gpu_between_seconds'), '.2f')} | | | |")
            continue
        lines.append(
            f"| {entry['step']} | {entry['tokens_per_second']:,.0f} | {fmt(entry.get('vs_neighbouring_bare'), '.3f')} | "
            f"{fmt(entry.get('gpu_span_vs_bare'), '.3f')} | {entry.get('tail_seconds', 0):.2f} | "
            f"{entry.get('tail_after_landed_seconds', 0):.2f} | {fmt(entry.get('gpu_forward_vs_bare'), '.3f')} | "
            f"{fmt(entry.get('gpu_between_seconds'), '.2f')} | {fmt(entry.get('gpu_head_seconds'), '.2f')} | "
            f"{fmt(entry.get('gpu_tail_seconds'), '.2f')} | {100 * entry['writer_busy_fraction']:.0f}% |")
    return "\n".join(lines)


def write_outputs(args: argparse.Namespace, state: dict[str, Any], started: float) -> None:
    """extract-h200.json (issue 13's keys) and split-target.json (issue 16's) from what ran so far."""
    out = Path(args.out)
    runs, bare, compared = state["runs"], state["bare"], state["compared"]

    # --sequence runs: each name's median over its repeats (the issue's keys filled alike).
    by_name: dict[str, list[float]] = {}
    for entry in state.get("sequence") or []:
        if entry["step"] != "bare":
            by_name.setdefault(entry["step"], []).append(entry["tokens_per_second"])

    def tps(name: str) -> float | None:
        if name in runs:
            return runs[name]["tokens_per_second"]
        return statistics.median(by_name[name]) if name in by_name else None

    bare_runs = [b["bare_tokens_per_s"] for b in (bare, state.get("bare_after")) if b]
    if state.get("sequence"):
        bare_runs = [e["bare_tokens_per_s"] for e in state["sequence"] if e["step"] == "bare"]
    bare_tps = sum(bare_runs) / len(bare_runs) if bare_runs else None
    ratios = sequence_ratios(state)  # also puts each sequence run's ratios on its entry
    results = {
        "bare_tokens_per_s": bare_tps,
        "ray": {
            "bf16": {"gpus_1": tps("bf16-1"), "gpus_2": tps("bf16-2")},
            "fp8_e4m3": {"gpus_1": tps("fp8-1"), "gpus_2": tps("fp8-2")},
        },
        "padding_fraction": runs["bf16-1"]["padding_waste"] if "bf16-1" in runs else (bare or {}).get("padding_fraction"),
        "disk_gb_per_s": state["disk"],
        "per_gpu_vs_bare": {
            name: r["tokens_per_second"] / (gpus_of(name) * bare_tps)
            for name, r in runs.items() if name != "split" and bare_tps
        } or {name: statistics.median(values) for name, values in ratios.items()},
        "writer_busy_fraction": {name: r["writer_busy_fraction"] for name, r in runs.items()},
        # Where the gap to the bare forward goes: the share of the run spent in forwards, and the
        # seconds before the first unit's forwards (head) and after the last one's (tail).
        "compute_busy_fraction": {name: r.get("compute_busy_fraction") for name, r in runs.items()},
        "head_seconds": {name: r.get("head_seconds") for name, r in runs.items()},
        "tail_seconds": {name: r.get("tail_seconds") for name, r in runs.items()},
        "write_gb_per_s": {name: r["write_gb_per_s"] for name, r in runs.items()},
        "store_bytes_per_token": {name: r["bytes_per_token"] for name, r in runs.items()},
        "num_tokens": (bare or {}).get("num_tokens"),
        "bare": bare,
        "bare_after": state.get("bare_after"),
        "bare_runs_tokens_per_s": bare_runs,
        "runs": runs,
        "sequence_ratios": ratios,
        "sequence": state.get("sequence"),
        "settings": settings_of(args),
        "machine": state["machine"],
        "command": " ".join([os.path.relpath(sys.argv[0], REPO_ROOT), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_seconds": time.time() - started,
    }
    (out / "extract-h200.json").write_text(json.dumps(results, indent=2))
    if "split" in runs:
        split_target = {
            "split_target": {
                "gpus": args.split_gpus,
                "tokens_per_s": runs["split"]["tokens_per_second"],
                "one_gpu_tokens_per_s": tps("bf16-1"),
                "max_rel_err_vs_one_gpu": compared.get("split_max_rel_err_same_batches"),
                "max_rel_err_vs_one_gpu_store": compared.get("split_max_rel_err_vs_store"),
                "samples_compared": compared.get("split_samples_compared"),
                "num_tokens": runs["split"]["num_tokens_written"],
                "note": "max_rel_err_vs_one_gpu: the split store against the same batches' features "
                "computed by the same capture code on one GPU; _store: against the 1-GPU bf16 store "
                "(the same samples, batched differently)",
            },
            "machine": state["machine"],
            "date": results["date"],
        }
        (out / "split-target.json").write_text(json.dumps(split_target, indent=2))


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func", "out", "work")}


def machine_facts(args: argparse.Namespace) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    facts: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
    }
    try:
        import ray

        facts["ray"] = ray.__version__
    except ImportError:
        pass
    if args.device == "cuda":  # asked of nvidia-smi: this process keeps no CUDA context on the GPUs
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        facts["gpus"] = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
    return facts


def gpus_of(name: str) -> int:
    """GPUs of a run by its name: "split" is one actor on several; "bf16-2" is 2 actors of one GPU."""
    return 1 if name == "split" else int(name.split("-")[1])


def table(results: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    bare_tps = results["bare_tokens_per_s"]
    bare_runs = " / ".join(f"{b:,.0f}" for b in results.get("bare_runs_tokens_per_s", []))
    lines = [
        f"bare forward (no mask, same batches): {bare_tps:,.0f} tok/s (runs {bare_runs}); padding {100 * results['padding_fraction']:.2f}%; "
        f"disk {results['disk_gb_per_s']:.2f} GB/s; {results['num_tokens']:,} tokens",
        "| run | tokens/s | per GPU vs bare | writer busy | written GB/s | forwards busy | head s | tail s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        gpus = gpus_of(name)
        label = f"{name} (1 actor, {2} GPUs, {r['num_tokens_written']:,} tokens)" if name == "split" else name
        lines.append(
            f"| {label} | {r['tokens_per_second']:,.0f} | {r['tokens_per_second'] / gpus / bare_tps:.3f} | "
            f"{100 * r['writer_busy_fraction']:.0f}% | {r['write_gb_per_s']:.2f} | "
            f"{100 * r.get('compute_busy_fraction', 0):.1f}% | {r.get('head_seconds', 0):.2f} | {r.get('tail_seconds', 0):.2f} |"
        )
    return "\n".join(lines)


def add_workload_arguments(parser: argparse.ArgumentParser, *, work: str, tokens: int, deadline_s: float) -> None:
    """The model, data, batching and output options this mode's steps read (gpu_limit.py's too)."""
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/hsstore-gpu-out"))
    parser.add_argument("--work", default=work)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(AUX_LAYER_IDS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--executor", default="ray", choices=["ray", "local", "auto"])
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--min-length", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-length-cap", type=int, default=4096, help="batching.max_length")
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--unit-tokens", type=int, default=262144)
    parser.add_argument("--cpus-per-worker", type=float, default=8)
    parser.add_argument("--planning-workers", type=int, default=4, help="planning.num_workers of each run")
    parser.add_argument("--compile-backend", default="inductor",
                        help="model.compile_backend of the -compiled runs (the smoke tests: aot_eager, no C++ compile)")
    parser.add_argument("--compare-samples", type=int, default=32, help="samples compared against one GPU's eager capture")
    parser.add_argument("--deadline-s", type=float, default=deadline_s, help="start no step after this many seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "prepare", "bare", "compare"])
    add_workload_arguments(parser, work="/tmp/hsstore-work/extract-ray", tokens=1_200_000, deadline_s=400)
    parser.add_argument("--gpus", type=int, default=2, help="GPUs on the machine (runs with more actors are skipped)")
    parser.add_argument("--split-gpus", type=int, default=2, help="GPUs of the split-target actor (1: no split run)")
    parser.add_argument("--split-records", type=int, default=200, help="records the split run extracts")
    parser.add_argument("--disk-gib", type=float, default=4.0)
    parser.add_argument("--runs", default="bf16-1,fp8-1,bf16-2,fp8-2,split",
                        help="which extraction runs (a long run splits over two device calls, the bare forward runs in each); "
                        "bf16-1-local / fp8-1-local: in process (executor=local)")
    parser.add_argument("--bare-after", action="store_true", help="run the bare forward again after the extraction runs")
    parser.add_argument("--sequence", default=None,
                        help="steps in this order instead of --runs, e.g. bare,fp8-1,bare,fp8-1-shm,bare "
                        "(each run compared with the bare passes beside it; -shm: the store in /dev/shm; "
                        "-trace: a torch.profiler trace of the first batches into --out/traces, no ratio)")
    parser.add_argument("--trace-batches", type=int, default=3, help="forwards a -trace run traces (profiler.batches)")
    args = parser.parse_args(argv)
    {"run": run, "prepare": prepare, "bare": bare, "compare": compare}[args.command](args)
    return 0

