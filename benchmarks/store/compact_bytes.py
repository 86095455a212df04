"""Bytes per token of every compact-store combination at H=4096 (issue 15, "Measure"), from the
codecs' exact sizes and compression ratios measured on the reference target's real features.

1. The reference target (examples/reference-target, H=384, 8 layers) is extracted once by the
   project's own extraction (in process, float32 compute on the CPU) with aux layers [2, 4, 5], the
   final state and the top-k teacher (``target_distribution: topk``, k = ``--topk``), every feature
   stored losslessly (float32).
2. The same values are written again for every codec x compression (aux and final: bf16 / fp8_e4m3;
   top-k logits: bf16 / float32 with int32 ids; each without and with zstd at level 1), and each
   feature's bytes on disk are divided by its uncompressed bytes: the measured ratio.
3. Bytes per token at H=4096 (3 aux layers) = the codec's exact raw size there (bf16 aux 24,576;
   fp8 aux 12,288 + 12 bytes of scales; final bf16 8,192, fp8 4,100; top-k k x (2 or 4) + k x 4)
   times the measured ratio. Only the ratios come from H=384; ``--quick`` for a tiny run.

Usage: ``python -m benchmarks.bench_store compact-bytes [--records 40] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import hsstore
from benchmarks.common import REPO_ROOT, write_results
from hsstore import FeatureSpec

H_TARGET = 4096
NUM_AUX = 3
AUX, FINAL, TOPK_LOGITS, TOPK_IDS = "aux_hidden_states", "final_hidden_state", "topk_logits", "topk_ids"


def extract(store: Path, records: int, topk: int) -> None:
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    recipe = build_recipe(ExtractRecipe, {
        "target": str(REPO_ROOT / "examples" / "reference-target"),
        "data": [str(REPO_ROOT / "examples" / "data" / "draft_train_slice.jsonl")],
        "store": str(store), "limit": records, "executor": "local",
        "model": {"dtype": "float32", "device": "cpu"},
        "capture": {"aux_layer_ids": [2, 4, 5], "final_hidden_state": True, "target_distribution": "topk", "topk_k": topk},
        "codecs": {name: {"codec": "float32"} for name in (AUX, FINAL, TOPK_LOGITS)},
        "batching": {"max_length": 512, "too_long": "truncate", "token_budget": 4096},
        "units": {"max_tokens": 1 << 20},
    })
    run_extraction(recipe)


def feature_bytes(store: hsstore.Store, name: str) -> int:
    return int(store.info()["features"][name]["bytes"])


def rewrite(source: hsstore.Store, path: Path, specs: list[FeatureSpec]) -> hsstore.Store:
    """The source's samples written again with ``specs`` (one shard, as extraction's units would)."""
    shutil.rmtree(path, ignore_errors=True)
    names = [spec.name for spec in specs]
    with hsstore.StoreWriter(str(path), specs, source.lineage, shard_max_tokens=1 << 30) as writer:
        for index in range(source.num_samples):
            sample = source.read_sample(index, names, as_numpy=True)
            writer.add_sample(
                sample_id=sample["sample_id"], source_id=sample["source_id"], input_ids=sample["input_ids"],
                loss_mask=sample["loss_mask"], features={name: sample[name] for name in names},
            )
    return hsstore.open_store(str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=40)
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.records = 4
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-compact-"))
    try:
        extract(workdir / "source", args.records, args.topk)
        source = hsstore.open_store(str(workdir / "source"))
        hidden = source.features[FINAL].shape[0]
        ratios: dict[str, float] = {}
        for codec, compression in itertools.product(("bf16", "fp8_e4m3"), ("none", "zstd")):
            store = rewrite(source, workdir / f"{codec}-{compression}", [
                FeatureSpec(name=AUX, shape=(NUM_AUX, hidden), codec=codec, compression=compression),
                FeatureSpec(name=FINAL, shape=(hidden,), codec=codec, compression=compression),
            ])
            for name in (AUX, FINAL):
                raw = store.features[name].raw_bytes_per_token * store.num_tokens
                ratios[f"{name}:{codec}:{compression}"] = feature_bytes(store, name) / raw
        for codec, compression in itertools.product(("bf16", "float32"), ("none", "zstd")):
            store = rewrite(source, workdir / f"topk-{codec}-{compression}", [
                FeatureSpec(name=TOPK_LOGITS, shape=(args.topk,), codec=codec, compression=compression),
                FeatureSpec(name=TOPK_IDS, shape=(args.topk,), codec="int32", compression=compression),
            ])
            raw = sum(store.features[n].raw_bytes_per_token for n in (TOPK_LOGITS, TOPK_IDS)) * store.num_tokens
            ratios[f"topk:{codec}:{compression}"] = (feature_bytes(store, TOPK_LOGITS) + feature_bytes(store, TOPK_IDS)) / raw
        num_tokens = source.num_tokens
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    # Exact raw sizes at H=4096 from the codecs themselves.
    def raw(name: str, codec: str, shape: tuple[int, ...]) -> int:
        return FeatureSpec(name=name, shape=shape, codec=codec).raw_bytes_per_token

    aux_raw = {c: raw(AUX, c, (NUM_AUX, H_TARGET)) for c in ("bf16", "fp8_e4m3")}
    teachers: dict[str, tuple[str, int]] = {
        "final bf16": ("final_hidden_state:bf16", raw(FINAL, "bf16", (H_TARGET,))),
        "final fp8": ("final_hidden_state:fp8_e4m3", raw(FINAL, "fp8_e4m3", (H_TARGET,))),
        f"top-{args.topk} (bf16 logits + int32 ids)": ("topk:bf16", raw(TOPK_LOGITS, "bf16", (args.topk,)) + raw(TOPK_IDS, "int32", (args.topk,))),
    }
    rows = []
    for aux_codec, (teacher, (key, teacher_raw)), compression in itertools.product(aux_raw, teachers.items(), ("none", "zstd")):
        # Uncompressed sizes are exact (the ratio measured there, >1, is only this small store's
        # padded edge chunks: at most one chunk per array per 4M-token shard in real stores).
        aux_bytes = aux_raw[aux_codec] * (ratios[f"{AUX}:{aux_codec}:{compression}"] if compression != "none" else 1.0)
        teacher_bytes = teacher_raw * (ratios[f"{key}:{compression}"] if compression != "none" else 1.0)
        rows.append({
            "aux": aux_codec, "teacher": teacher, "compression": compression,
            "aux_bytes": round(aux_bytes), "teacher_bytes": round(teacher_bytes),
            "bytes_per_token_h4096": round(aux_bytes + teacher_bytes),
        })
    report = {
        "command": " ".join(["bench_compact_bytes.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "measured_on": f"reference target, H={hidden}, {num_tokens:,} tokens of {args.records} records, level-1 zstd",
        "compression_ratios": {k: round(v, 4) for k, v in ratios.items()},
        "rows": rows,
    }
    print(f"\ncompression ratios measured on {report['measured_on']}:")
    for key, value in report["compression_ratios"].items():
        print(f"  {key}: {value:.3f}")
    print("\n| aux | teacher | compression | aux B/token | teacher B/token | total B/token at H=4096 | vs peers' 32,768 |")
    print("|---|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['aux']} | {row['teacher']} | {row['compression']} | {row['aux_bytes']:,} | {row['teacher_bytes']:,} | {row['bytes_per_token_h4096']:,} | {row['bytes_per_token_h4096'] / 32768:.3f} |")
    if args.out:
        write_results(args.out, report)
    return 0

