"""What every benchmark script shares: its argument parser, the machine it ran on, the results
file it writes, and the dispatch to its modes.

Scripts run as modules from the repository root (``python -m benchmarks.bench_store``), so
``hsstore``, ``pipelines`` and ``tests.support`` import without touching ``sys.path``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# Set by the CPU smoke tests: a benchmark's steps run in the calling process instead of processes
# of their own. On a GPU the steps' own processes are the point (each run starts from a clean
# device and a cold compile cache); on 2 CPU cores a process costs ~3.5 s of torch and
# transformers imports, most of a tiny step. tests/benchmarks/test_common.py runs a step both ways.
STEPS_IN_PROCESS_ENV = "HSSTORE_BENCH_STEPS_IN_PROCESS"


def run_python_module(
    module: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGV`` from the repository root (``env``: its whole environment, default
    this one's; ``timeout``: ``subprocess.TimeoutExpired`` past it): its exit code and output, or
    with ``log`` its stdout and stderr into that file. In this process (``MODULE.main(ARGV)``,
    ``env`` as the environment for the call, this one's restored after; no timeout) when
    ``STEPS_IN_PROCESS_ENV`` is set."""
    if not os.environ.get(STEPS_IN_PROCESS_ENV):
        command = [sys.executable, "-m", module, *argv]
        if log is None:
            return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=timeout)
        with open(log, "w", encoding="utf-8") as out:
            done = subprocess.run(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        return subprocess.CompletedProcess(done.args, done.returncode, "", "")
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    if env is not None:  # the step's whole environment, as a child process would get it
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout if log else stderr):
            code = importlib.import_module(module).main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
        (stdout if log else stderr).write(f"{stop}\n")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if log is not None:
        log.write_text(stdout.getvalue(), encoding="utf-8")
        return subprocess.CompletedProcess([module, *argv], int(code or 0), "", "")
    return subprocess.CompletedProcess([module, *argv], int(code or 0), stdout.getvalue(), stderr.getvalue())


def parser(doc: str | None, *, prog: str | None = None, defaults: bool = False) -> argparse.ArgumentParser:
    """The script's parser: its module docstring as the help text (kept as written)."""
    formatter = argparse.ArgumentDefaultsHelpFormatter if defaults else argparse.RawDescriptionHelpFormatter
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=formatter)


def add_out(parser: argparse.ArgumentParser, default: str | Path | None = None) -> None:
    """``--out``: where the JSON result goes (:func:`write_results`); none prints only."""
    where = f" (default {default})" if default else ""
    parser.add_argument("--out", type=Path, default=Path(default) if default else None, help=f"JSON result file{where}")


def machine_info() -> dict[str, Any]:
    """The machine and software a number was measured on: CPU, cores, memory, GPUs, versions of
    the libraries already imported, hsstore's commit, and the date (UTC)."""
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    cpuinfo, meminfo = Path("/proc/cpuinfo"), Path("/proc/meminfo")
    if cpuinfo.exists():
        info["cpu"] = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")), platform.processor())
    if meminfo.exists():
        total = next((line.split()[1] for line in meminfo.read_text().splitlines() if line.startswith("MemTotal")), None)
        info["mem_total_kib"] = int(total) if total else None
    for name in ("hsstore", "torch", "transformers", "zarr", "numpy", "ray"):
        module = sys.modules.get(name)  # only what the script imported: asking costs no import
        if module is not None and hasattr(module, "__version__"):
            info[name] = module.__version__
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["hsstore_commit"] = _commit()
    return info


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%h %cI"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "hsstore", "pipelines"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{' (uncommitted changes)' if dirty else ''}" if head else None


def write_results(path: str | Path | None, results: dict[str, Any], *, indent: int = 2) -> None:
    """Write ``results`` as JSON to ``path`` (parents created); nothing when ``path`` is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent, default=str) + "\n")


def update_section(path: str | Path, section: str, values: dict[str, Any]) -> dict[str, Any]:
    """Merge ``values`` into the ``section`` object of the JSON file at ``path`` (created if
    absent), keeping every other section and key: a results file that several benchmarks fill,
    each its own part (``gpu-limit-h200.json``: ``extract`` and ``train``). Returns the file's data."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(section, {}).update(values)
    write_results(path, data)
    return data


def run_modes(argv: Sequence[str] | None, default: Callable[[list[str]], int], modes: dict[str, str], *, prog: str) -> int:
    """A script's modes: ``prog MODE [args]`` runs ``main(args)`` of the module ``modes[MODE]``;
    anything else is the script's own (default) run. ``prog modes`` lists them."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in modes:
        module = importlib.import_module(modes[args[0]])
        program, sys.argv[0] = sys.argv[0], f"{prog} {args[0]}"  # what the mode's --help shows
        try:
            return module.main(args[1:])
        finally:
            sys.argv[0] = program
    if args[:1] == ["modes"]:
        for name, module_name in modes.items():
            doc = (importlib.import_module(module_name).__doc__ or "").strip().splitlines()
            print(f"{prog} {name}: {doc[0] if doc else ''}")
        return 0
    return default(args)
