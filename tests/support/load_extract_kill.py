"""A long CPU extraction with a Ray worker SIGKILLed every N committed units (issue 7, "Load").

What it shows: the job finishes with exactly the planned samples (nothing lost, nothing twice, every
shard passing ``verify``), and throughput comes back after each kill (Ray restarts the actor, which
reloads the target and reruns the unit it was writing, into a fresh attempt folder).

Data: ``../shared/data/draft_train.jsonl`` (476 records, text and chats) replicated with changed ids
and text to ``--records`` (default 2000), so every copy is a distinct sample. Target: the in-repo
reference target (``examples/reference-target``), float32 on the CPU, 2 Ray actors of 1 CPU each.

Reported (JSON on stdout and ``--out``): wall time, tokens/s overall and per window between kills,
each kill's time, the pid killed, and the time until the next commit (recovery); final checks.

Usage (from the repository root; not run in CI, the suite runs a short version of it)::

    python -m tests.support.load_extract_kill                       # ~2000 records, a kill every 8 units
    python -m tests.support.load_extract_kill --records 400 --kill-every 4 --out /tmp/load.json
    python -m tests.support.load_extract_kill --no-kill             # the same run undisturbed, to compare
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.support.paths import REFERENCE_TARGET, SHARED_DATA

SHARED_TRAIN = SHARED_DATA / "draft_train.jsonl"


def replicate_records(source: Path, target: Path, num_records: int) -> Path:
    """Copies of ``source``'s records, each with a new id and a marker in its text, until
    ``num_records``: distinct content, hence distinct sample ids (no duplicate rejections)."""
    originals = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    with target.open("w", encoding="utf-8") as handle:
        for n in range(num_records):
            record = json.loads(json.dumps(originals[n % len(originals)]))
            copy = n // len(originals)
            record["id"] = f"{record.get('id', n)}#copy{copy}"
            marker = f"[copy {copy}] "
            if "text" in record:
                record["text"] = marker + record["text"]
            else:
                turns = record.get("messages") or record.get("conversations")
                first = turns[0]
                key = "content" if "content" in first else "value"
                first[key] = marker + first[key]
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return target


def actor_processes(busy: bool, raylet: int | None = None) -> list[int]:
    """Pids of live extraction actors (Ray titles them ``ray::_WorkerActor[.method]``); ``busy``:
    only those executing ``run_unit``, i.e. in the middle of writing a shard. ``raylet``: only the
    actors that raylet started (its children), not another Ray's on the machine (a parallel test's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            # /proc/PID/stat: "pid (comm) state ppid ...": the parent after the command's ")".
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if raylet is not None and parent != raylet:
            continue
        if title.startswith("ray::_WorkerActor") and (not busy or "run_unit" in title):
            pids.append(int(entry.name))
    return pids


def own_raylet() -> int:
    """The pid of the raylet of the Ray this process started (the actors' parent)."""
    import ray

    node = ray._private.worker._global_node
    if node is None:
        raise RuntimeError("this process did not start its Ray: its raylet is not known here")
    return node.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


@dataclass
class Kill:
    at_s: float
    pid: int
    after_units: int
    next_commit_s: float | None = None


@dataclass
class LoadResult:
    records: int
    units: int
    samples: int
    tokens: int
    wall_s: float
    extract_s: float
    tokens_per_s: float
    kills: list[Kill] = field(default_factory=list)
    commits: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, tokens)
    window_tokens_per_s: list[float] = field(default_factory=list)
    exact: bool = False
    verify_fatal: list[str] = field(default_factory=list)
    garbage_files: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_load(
    workdir: Path,
    *,
    records: int,
    kill_every: int | None,
    max_length: int = 256,
    unit_tokens: int = 4096,
    data_source: Path | None = None,
    num_workers: int = 2,
    ray_started: bool = False,
) -> LoadResult:
    """Extract ``records`` records into ``workdir/store`` with a busy actor SIGKILLed after every
    ``kill_every`` commits (at the first commit after that with an actor busy; None: no kills), and
    check the end state exactly."""
    import hsstore
    from hsstore.storage import StoreLocation
    from hsstore.verify import verify_store
    from pipelines.extract import run_extraction
    from pipelines.extract.planner import StreamPlanner
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.extract.tokenizer_pool import make_sample_tokenizer
    from pipelines.recipe import build_recipe

    data = data_source or replicate_records(SHARED_TRAIN, workdir / "records.jsonl", records)
    store = workdir / "store"
    overrides = {
        "target": str(REFERENCE_TARGET),
        "data": f"[{data}]",
        "store": str(store),
        "executor": "ray",
        "model.dtype": "float32",  # CPU bf16 matmuls are several times slower
        "model.device": "cpu",
        "batching.max_length": max_length,
        "batching.too_long": "truncate",
        "batching.token_budget": max(4 * max_length, 1024),
        "units.max_tokens": unit_tokens,
        "codecs.chunk_bytes": 1 << 20,
        "ray.num_workers": num_workers,
        "ray.num_cpus_per_worker": 1,
        # Every kill costs the actor a restart and the unit a retry: allow as many as the run has.
        "ray.max_restarts": 1000,
        "ray.max_task_retries": 1000,
    }
    recipe = build_recipe(ExtractRecipe, {}, [f"{k}={v}" for k, v in overrides.items()], source="load")
    start = time.perf_counter()
    kills: list[Kill] = []
    commits: list[tuple[float, int]] = []
    owed = [0]  # kills due and not yet made

    def on_commit(result: Any, executor: Any) -> None:
        now = time.perf_counter() - start
        commits.append((now, result.num_tokens))
        for kill in kills:
            if kill.next_commit_s is None:
                kill.next_commit_s = now - kill.at_s
        if kill_every and len(commits) % kill_every == 0:
            owed[0] += 1
        if not owed[0]:
            return
        # This hook runs on the driver, which hands the next unit out only after it returns: waiting
        # here long for a busy actor starves the survivor (the victim of the last kill may still be
        # restarting), so a kill not made within 2 s is owed to the next commit instead.
        deadline, raylet = time.monotonic() + 2, own_raylet()
        while not (busy := actor_processes(busy=True, raylet=raylet)) and time.monotonic() < deadline:
            time.sleep(0.01)
        if busy:
            os.kill(busy[0], signal.SIGKILL)
            kills.append(Kill(at_s=time.perf_counter() - start, pid=busy[0], after_units=len(commits)))
            owed[0] -= 1

    if not ray_started:
        import ray

        ray.init(num_cpus=num_workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        summary = run_extraction(recipe, on_commit=on_commit)
    finally:
        if not ray_started:
            import ray

            ray.shutdown()
    wall = time.perf_counter() - start
    tokenizer = make_sample_tokenizer(recipe, recipe.target)
    expected = {sample_id for window in StreamPlanner(recipe, tokenizer, recipe.target).windows() for sample_id, _ in window.samples}
    opened = hsstore.open_store(str(store))
    ids = opened.samples.column("sample_id").to_pylist()
    problems = verify_store(StoreLocation(str(store)))
    result = LoadResult(
        records=summary.num_records,
        units=summary.num_units,
        samples=len(ids),
        tokens=opened.num_tokens,
        wall_s=round(wall, 2),
        extract_s=round(summary.extract_seconds, 2),
        tokens_per_s=round(summary.tokens_per_second, 1),
        kills=kills,
        commits=[(round(t, 3), n) for t, n in commits],
        exact=len(ids) == len(expected) and set(ids) == expected,
        verify_fatal=[str(p) for p in problems if p.fatal],
        garbage_files=sum(1 for p in problems if p.kind == "unreferenced"),
    )
    result.window_tokens_per_s = _window_rates(commits, [k.at_s for k in kills])
    return result


def _window_rates(commits: list[tuple[float, int]], cuts: list[float]) -> list[float]:
    """Tokens/s committed between consecutive kills (the first window starts at the first commit)."""
    if not commits:
        return []
    edges = [commits[0][0], *cuts, commits[-1][0]]
    rates = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        tokens = sum(n for t, n in commits if lo < t <= hi)
        rates.append(round(tokens / (hi - lo), 1) if hi > lo else 0.0)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--kill-every", type=int, default=8, help="SIGKILL a busy actor after every N commits")
    parser.add_argument("--no-kill", action="store_true", help="the same run without kills (baseline)")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--unit-tokens", type=int, default=4096)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if not SHARED_TRAIN.exists():
        print(f"{SHARED_TRAIN} not found (the shared data beside the checkout)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="load-extract-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = run_load(
            workdir,
            records=args.records,
            kill_every=None if args.no_kill else args.kill_every,
            max_length=args.max_length,
            unit_tokens=args.unit_tokens,
        )
    text = json.dumps(result.to_json(), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    ok = result.exact and not result.verify_fatal
    print(
        f"{'OK' if ok else 'FAILED'}: {result.samples} samples, {result.tokens} tokens in {result.wall_s} s "
        f"({result.tokens_per_s} tokens/s), {len(result.kills)} kills, windows {result.window_tokens_per_s}",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
