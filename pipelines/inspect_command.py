"""``hsstore inspect STORE``: a readable (or ``--json``) summary of a store, and ``--plots DIR``.

The numbers come from :mod:`hsstore.inspect`; this module only parses arguments and prints. The
exit status is 1 when a shard is damaged (the summary of the rest is still printed), so scripts can
gate on it like on ``hsstore verify``.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "inspect",
        help="lineage, features, lengths, loss masks, token frequency, per-layer norms and outliers",
        description="Summarise a store: lineage, features and codecs, samples/tokens, length "
        "histogram, loss-mask coverage, token frequency head, per-layer hidden-state norm and "
        "outlier statistics, bytes per token. Damaged shards are named and left out.",
    )
    parser.add_argument("store", help="store URL (path, file://, memory://, s3://, gs://)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--plots", metavar="DIR", help="also write PNG plots into DIR")
    parser.add_argument(
        "--max-tokens", type=int, default=4096,
        help="tokens read for the layer statistics, spread over the shards (default 4096)",
    )
    parser.add_argument("--top-tokens", type=int, default=20, help="rows of the token frequency head")
    parser.add_argument("--bins", type=int, default=20, help="bins of the length histogram")
    parser.add_argument(
        "--no-checksums", action="store_true",
        help="verify sizes and structure only, not sha256 (fast on large stores)",
    )
    parser.add_argument(
        "--decode", action="store_true",
        help="show decoded tokens (needs the lineage's tokenizer as a local directory, or --tokenizer)",
    )
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory for --decode")
    parser.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    import hsstore
    from hsstore import inspect as hi

    store = hsstore.open_store(args.store)
    tokenizer = (args.tokenizer or "auto") if args.decode else None
    report = hi.summary(
        store,
        checksums=not args.no_checksums,
        max_tokens=args.max_tokens,
        bins=args.bins,
        top_tokens=args.top_tokens,
        tokenizer=tokenizer,
    )
    if args.plots:
        plots = hi.write_plots(store, args.plots, max_tokens=args.max_tokens, skip_shards=set(report["health"]["bad_shards"]))
        report["plots"] = {name: str(path) for name, path in plots.items()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(hi.format_summary(report))
        for name, path in report.get("plots", {}).items():
            print(f"plot       {name}: {path}")
    if not report["health"]["ok"]:
        bad = ", ".join(report["health"]["bad_shards"]) or "see store problems"
        print(f"{args.store}: damaged shard(s) left out of the summary: {bad}", file=sys.stderr)
        return 1
    return 0
