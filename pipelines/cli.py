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
        return int(args.func(args) or 0)
    except HsstoreError as err:
        print(f"hsstore {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hsstore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
