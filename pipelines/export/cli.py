"""``hsstore export CHECKPOINT --format {eagle3,speculators,eagle4} --out DIR`` (parsers only;
torch is imported by the handler)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a trained draft in a layout a serving engine loads (eagle3, speculators, eagle4)",
        description=(
            "Export CHECKPOINT (a training run's folder, whose checkpoints/final is used; a "
            "training checkpoint directory holding draft/; or a directory with config.json + "
            "model.safetensors) as config.json + model.safetensors: eagle3 = "
            "LlamaForCausalLMEagle3 (vLLM, SGLang); speculators = speculators' model format "
            "(vLLM with no conversion, the aux layer ids and embedding included); eagle4 = "
            "eagle-harness's LlamaForCausalLMEagle4. See docs/serving-layouts.md."
        ),
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="training run folder or checkpoint directory"
    )
    parser.add_argument(
        "--format",
        choices=("eagle3", "speculators", "eagle4"),
        default="eagle3",
        help="serving layout",
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
        help="eagle3/eagle4: also write embed_tokens.weight (the target's embedding); the "
        "engines share the target's. speculators always includes it",
    )
    parser.add_argument(
        "--verifier",
        metavar="NAME_OR_PATH",
        help="speculators: the target (Hugging Face id or path) recorded as the verifier; default "
        "the training run's recipe target",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        metavar="N",
        help="speculators: the greedy proposal's draft length; default the run's ttt_length (else 3)",
    )
    parser.add_argument(
        "--expand-vocab",
        action="store_true",
        help="eagle4: write a reduced-vocabulary draft's heads over the full vocabulary (rows of "
        "target ids outside the draft vocabulary are zero)",
    )
    parser.add_argument(
        "--eagle31-keys",
        action="store_true",
        help="eagle3: write an EAGLE-3.1 draft's fc_norm/norm_output (vLLM and TensorRT-LLM read "
        "them; SGLang's LlamaForCausalLMEagle3 ignores them)",
    )
    parser.set_defaults(func=run_export)
    register_export_features(subparsers)


def run_export(args: argparse.Namespace) -> int:
    from pipelines.export.serving import export_draft

    out = export_draft(
        args.checkpoint,
        args.format,
        args.out,
        dtype=args.dtype,
        overwrite=args.overwrite,
        include_embed_tokens=args.include_embed_tokens,
        verifier=args.verifier,
        speculative_tokens=args.speculative_tokens,
        expand_vocab=args.expand_vocab,
        eagle31_keys=args.eagle31_keys,
    )
    print(f"exported {args.format} draft to {out}")
    return 0


def register_export_features(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-features",
        help="write a store's samples in SpecForge's or speculators' offline feature layout",
        description=(
            "Stream STORE's samples into a peer trainer's offline layout: specforge (one torch.save "
            "file per sample, bit-exact) or speculators (a datasets folder + hs_<i>.safetensors). "
            "A README.md and hsstore-export.json beside the files record the target, the aux layer "
            "ids and each file's sample id, which neither layout holds. See docs/peer-formats.md."
        ),
    )
    parser.add_argument("store", metavar="STORE", help="store URL or path")
    parser.add_argument("--format", choices=("specforge", "speculators"), required=True, help="layout")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--limit", type=int, default=None, help="export only the first N selected samples")
    parser.add_argument(
        "--samples",
        default=None,
        metavar="SPEC",
        help="which samples, in this order: indices and ranges (0-99,120) or @FILE of sample ids",
    )
    parser.add_argument(
        "--target",
        default=None,
        metavar="DIR",
        help="the target's directory (speculators: its final-norm weight rebuilds the pre-norm slot)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_export_features)


def run_export_features(args: argparse.Namespace) -> int:
    import hsstore
    from pipelines.export.features import export_features, parse_sample_selection

    samples = None
    if args.samples is not None:
        samples = parse_sample_selection(args.samples, hsstore.open_store(args.store))
    summary = export_features(
        args.store,
        args.out,
        args.format,
        samples=samples,
        limit=args.limit,
        target=args.target,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(
        f"exported {summary.num_samples} samples ({summary.num_tokens} tokens, "
        f"{summary.bytes_written / 1e6:.1f} MB) as {summary.format} to {summary.out_dir} "
        f"in {summary.seconds:.1f} s"
    )
    return 0
