"""``hsstore import --from specforge|speculators DIR STORE --target TARGET_DIR --aux-layer-ids ...``
(parsers only; torch is imported by the handler)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def _layer_ids(value: str) -> list[int]:
    try:
        ids = [int(part) for part in value.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of layer ids") from err
    if not ids or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"{value!r}: give distinct layer ids, e.g. 2,4,5")
    return ids


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "import",
        help="stream a peer's per-sample feature dumps (SpecForge, speculators) into a store",
        description=(
            "Import DIR, written by SpecForge's offline data preparation (rows_*/data_<i>.ckpt) or "
            "speculators' hs-connectors (a datasets folder + hidden_states/hs_<i>.safetensors), "
            "into STORE. Neither records the target or the layers: state them. Resumable (units "
            "already committed are skipped). See docs/peer-formats.md."
        ),
    )
    parser.add_argument("source", metavar="DIR", help="the peer's dump")
    parser.add_argument("store", metavar="STORE", help="store URL (created, or resumed)")
    parser.add_argument("--from", dest="format", required=True, choices=("specforge", "speculators"))
    parser.add_argument("--target", required=True, metavar="TARGET_DIR", help="the target model directory the dump came from")
    parser.add_argument(
        "--aux-layer-ids", required=True, type=_layer_ids, metavar="I,J,K",
        help="the dump's aux layers in the Hugging Face hidden_states numbering (SpecForge's and "
        "SGLang's ids are one lower: add 1), in the order the dump concatenates them",
    )
    parser.add_argument(
        "--final-state", choices=("pre_norm", "post_norm"),
        help="speculators (required): what the last hidden_states slot holds (hs-connectors: "
        "pre_norm, normed here with the target's final norm). SpecForge's is post_norm",
    )
    parser.add_argument("--codec", default=None, help="feature codec (bf16, fp8_e4m3, float32); default bf16")
    parser.add_argument("--compression", default=None, choices=("none", "zstd", "blosc"), help="default none")
    parser.add_argument(
        "--teacher", default=None, choices=("final_hidden", "topk"),
        help="keep the final state (default), or the target's top-k logits computed from it",
    )
    parser.add_argument("--topk-k", type=int, default=None, help="k for --teacher topk (default 20)")
    parser.add_argument(
        "--preset", choices=("compact",),
        help="compact: fp8_e4m3 aux states, top-20 logits, zstd (docs/compact-store.md); the "
        "flags above override it",
    )
    parser.add_argument("--device", default="cpu", help="where --teacher topk projects (cpu, cuda)")
    parser.add_argument("--samples-per-shard", type=int, default=1024, help="files per shard (the unit of resume)")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="files read, checked, projected and encoded at once (default: the cores)",
    )
    parser.add_argument(
        "--workers", type=int, default=1,
        help="units written at once, each in its own process with its share of --threads",
    )
    parser.add_argument("--limit", type=int, default=None, help="import the first N files only")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    from pipelines.peer_import.importer import COMPACT, import_features

    preset = dict(COMPACT) if args.preset == "compact" else {}
    chosen = {
        "codec": args.codec or preset.get("codec", "bf16"),
        "compression": args.compression or preset.get("compression", "none"),
        "teacher": args.teacher or preset.get("teacher", "final_hidden"),
        "topk_k": args.topk_k or preset.get("topk_k", 20),
    }
    summary = import_features(
        args.source, args.store, format=args.format, target=args.target,
        aux_layer_ids=args.aux_layer_ids, final_state=args.final_state, **chosen,
        device=args.device, samples_per_shard=args.samples_per_shard,
        threads=args.threads, workers=args.workers, limit=args.limit,
        progress=not args.no_progress,
    )
    print(json.dumps(asdict(summary), indent=2))
    return 0
