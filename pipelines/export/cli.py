"""``hsstore export CHECKPOINT --format {eagle3,eagle4} --out DIR`` (parsers only; torch is
imported by the handler)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a trained draft in the vLLM/SGLang EAGLE-3 (or EAGLE-4) serving layout",
        description=(
            "Export CHECKPOINT (a training run's folder, whose checkpoints/final is used; a "
            "training checkpoint directory holding draft/; or a directory with config.json + "
            "model.safetensors) as LlamaForCausalLMEagle3: config.json + model.safetensors, "
            "without embed_tokens unless --include-embed-tokens. See docs/serving-layouts.md."
        ),
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="training run folder or checkpoint directory"
    )
    parser.add_argument(
        "--format", choices=("eagle3", "eagle4"), default="eagle3", help="serving layout"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="weight dtype",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    parser.add_argument(
        "--include-embed-tokens",
        action="store_true",
        help="also write embed_tokens.weight (the target's embedding), for converters such as "
        "vLLM's speculators that load the draft's embedding; vLLM/SGLang do not need it",
    )
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from pipelines.export.serving import export_draft

    out = export_draft(
        args.checkpoint,
        args.format,
        args.out,
        dtype=args.dtype,
        overwrite=args.overwrite,
        include_embed_tokens=args.include_embed_tokens,
    )
    print(f"exported {args.format} draft to {out}")
    return 0
