"""The ``hsstore`` console script.

Each job lives in its own package and contributes a subcommand through a ``register(subparsers)``
function in its ``cli`` module. Those modules only build argparse parsers; heavy imports (torch,
ray, transformers) happen inside the handlers, so ``hsstore info`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from hsstore.errors import HsstoreError
from hsstore.extras import EXTRA_OF_MODULE, missing_dependency

# Modules that contribute subcommands, in the order ``hsstore --help`` lists them.
SUBCOMMAND_MODULES = (
    "pipelines.store_commands",  # info, verify, gc: the store's own verbs
    "pipelines.inspect_command",
    "pipelines.generate.cli",
    "pipelines.extract.cli",
    "pipelines.train.cli",
    "pipelines.export.cli",
    "pipelines.peer_import.cli",
    "pipelines.evaluate.cli",
    "pipelines.sweep.cli",
    "pipelines.demo",
)


NOISY_LOGGERS = ("botocore", "aiobotocore", "s3fs")

# `pip install hsstore` runs the store's verbs (info, verify, gc, inspect); a job run on a base
# install stops with the extra to install instead of a traceback. The extra a command names when
# torch, transformers or Ray is missing (others: the module's own extra, hsstore.extras).
EXTRA_OF_COMMAND = {"extract": "extract", "generate": "extract", "sweep": "all", "demo": "all"}
# Checked before the handler runs: a sweep reports each point's failure and carries on, so a missing
# torch would read as one failed run per point.
REQUIRED_MODULES = {"sweep": ("torch", "transformers")}


def missing_extra_message(command: str, err: ModuleNotFoundError) -> str | None:
    """What to install for ``err`` (a module an extra provides), or None for any other module."""
    module = (err.name or "").partition(".")[0]
    if module not in EXTRA_OF_MODULE:
        return None
    extra = EXTRA_OF_MODULE[module]
    if extra in ("train", "extract"):
        extra = EXTRA_OF_COMMAND.get(command, extra)
    return str(missing_dependency(module, f"hsstore {command}", extra))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsstore",
        description="Extract target hidden states once; train, export and evaluate drafts many times.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # A job package not built yet in this checkout; every other import error is a bug.
            if err.name is not None and module_name.startswith(err.name):
                continue
            raise
        module.register(subparsers)
    return parser


# OpenMP threads that spin while they wait starve every other thread of the process on a small CPU:
# the loader's read threads, Ray's, a second process. A 2-core VM trained the draft 30x slower
# (~80 vs ~2,300 tokens/s, benchmarks/LOG.md) with torch's 2 threads spinning. Set before torch
# loads its OpenMP runtime (the handlers import torch); a value the user set wins.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def main(argv: Sequence[str] | None = None) -> int:
    for key, value in OPENMP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # botocore logs where it found the keys and the endpoint each time a client is made (zarr
        # makes one per array it opens): on an s3:// store, pages of lines saying nothing new.
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        for module in REQUIRED_MODULES.get(args.command, ()):
            importlib.import_module(module)
        return int(args.func(args) or 0)
    except HsstoreError as err:
        print(f"hsstore {args.command}: error: {err}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as err:
        hint = missing_extra_message(args.command, err)
        if hint is None:
            raise
        print(f"hsstore {args.command}: error: {hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hsstore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
