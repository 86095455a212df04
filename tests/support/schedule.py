"""The order in which pytest-xdist hands out test modules: longest first.

``make test`` runs two workers with ``--dist loadfile`` (a module at a time, so its fixtures are
built once). By default xdist orders the modules by their number of tests, which puts the few long
end-to-end modules (a Ray cluster, the benchmarks' smoke runs, the demo) last: one worker then runs
the last of them alone while the other has nothing left. Handing them out longest first (LPT, as
pytest-split does with its durations file) lets the short modules fill the gaps at the end.

``module_seconds.json`` holds each module's seconds from one measured run; a module it does not
name counts as 0 (it goes last). Rebuild it from a run's ``--durations=0`` output, serial or on
the two workers (only the modules' order matters, and two workers slow every module alike):

    python -m pytest -n 2 --dist loadfile --durations=0 > /tmp/durations.log
    python -m tests.support.schedule /tmp/durations.log
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
_DURATION = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def recorded_seconds(path: Path = MODULE_SECONDS) -> dict[str, float]:
    """Module path (as pytest names it, from the repository root) -> seconds."""
    return json.loads(path.read_text()) if path.exists() else {}


def longest_modules_first(items: list[Any], seconds: dict[str, float]) -> None:
    """Sort ``items`` in place by their module's recorded seconds, longest first; the tests of one
    module keep their order (the sort is stable)."""
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))


def seconds_from_durations_log(text: str) -> dict[str, float]:
    """Each module's summed setup, call and teardown seconds from pytest's ``--durations=0`` lines."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = _DURATION.match(line.strip())
        if match:
            totals[match.group(2)] += float(match.group(1))
    return {module: round(total, 1) for module, total in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m tests.support.schedule DURATIONS_LOG", file=sys.stderr)
        return 2
    seconds = seconds_from_durations_log(Path(args[0]).read_text())
    if not seconds:
        print(f"{args[0]}: no '--durations=0' lines found", file=sys.stderr)
        return 1
    MODULE_SECONDS.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{MODULE_SECONDS}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
