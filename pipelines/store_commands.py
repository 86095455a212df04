"""The store's own verbs on the command line: ``info``, ``verify``, ``gc``.

They are implemented in ``hsstore`` (info, verify, gc modules); this module only parses arguments
and prints.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    info = subparsers.add_parser("info", help="samples, tokens, features, bytes per token, lineage")
    info.add_argument("store", help="store URL (path, file://, memory://, s3://, gs://)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_info)

    verify = subparsers.add_parser(
        "verify", help="check every committed file (size, checksum, counts, shapes); list garbage"
    )
    verify.add_argument("store")
    verify.add_argument("--no-checksums", action="store_true", help="sizes and structure only (fast)")
    verify.add_argument("--strict", action="store_true", help="unreferenced files also fail")
    verify.add_argument("--threads", type=int, default=None,
                        help="shards checked at once (default: the cores locally, 16 on object storage)")
    verify.set_defaults(func=_verify)

    gc = subparsers.add_parser("gc", help="delete shard folders no manifest names (crashed writers)")
    gc.add_argument("store")
    gc.add_argument("--min-age", type=float, default=3600.0, help="only folders older than this (s)")
    gc.add_argument("--dry-run", action="store_true")
    gc.set_defaults(func=_gc)


def _info(args: argparse.Namespace) -> int:
    import hsstore
    from hsstore.info import format_info

    info = hsstore.open_store(args.store).info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from hsstore.storage import StoreLocation
    from hsstore.verify import verify_store

    problems = verify_store(StoreLocation(args.store), checksums=not args.no_checksums, threads=args.threads)
    for problem in problems:
        print(problem)
    failing = [p for p in problems if p.fatal or args.strict]
    if failing:
        print(f"{args.store}: {len(failing)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.store}: OK" + (f" ({len(problems)} unreferenced file(s), see above)" if problems else ""))
    return 0


def _gc(args: argparse.Namespace) -> int:
    from hsstore.gc import collect_garbage
    from hsstore.storage import StoreLocation

    removed = collect_garbage(StoreLocation(args.store), min_age_s=args.min_age, dry_run=args.dry_run)
    for folder in removed:
        print(("would remove " if args.dry_run else "removed ") + folder)
    return 0
