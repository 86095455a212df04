#!/usr/bin/env bash
# EAGLE-3 vs EAGLE-3.1 (issue 30) on the lent H200: both drafts trained there, decoded here.
# Carry [".gpu/whl", ".gpu-data"]: hsstore's small wheels (../shared/gpu/make-bundle.sh; Ray is not
# needed: every job runs in process) and the raw-rung prompt set of the reference draft's ladder,
# built here and xz-packed (the GPU machine has another Python, hence other sources):
#   python3 -m pipelines.generate.source_prompts --out runs/source-raw.jsonl --max-files 4000 --human-answers 2000
#   mkdir -p .gpu-data && xz -9 -c runs/source-raw.jsonl > .gpu-data/source-raw.jsonl.xz
#   bash tools/gpu_eagle31.sh            # SEEDS="0 1" STEPS=1200 by default
# (~8 min for two seeds). Then, here: mkdir -p runs/eagle31-gpu && cat <files_at>/drafts.tar.xz.part.* | xz -dc |
# tar xf - -C runs/eagle31-gpu, and for each seed N:
#   python3 -m benchmarks.bench_train eagle31 --stage evaluate --device cpu \
#       --workdir runs/eagle31-gpu/seedN --out runs/eagle31-gpu/seedN/eagle31.json
set -uo pipefail
OUT=${OUT:-/tmp/eagle31-out}
STEPS=${STEPS:-1200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/eagle31
mkdir -p "$W"
[ -f "$W/source-raw.jsonl" ] || xz -dc .gpu-data/source-raw.jsonl.xz > "$W/source-raw.jsonl"
for seed in ${SEEDS:-0 1}; do
  python3 -m benchmarks.bench_train eagle31 --stage train --device cuda --seed "$seed" --steps "$STEPS" \
    --recipe recipes/reference/train-reference-draft.yaml --data "$W/source-raw.jsonl" --extract-limit 4000 \
    --store "$W/store" --heldout-store "$W/heldout-store" --workdir "$W/seed$seed" \
    --out "$W/seed$seed/eagle31.json" --set log_every=100 2>&1 | tr "\r" "\n" | grep -v "^train draft" | tail -n 12 | tee "$OUT/seed$seed.log"
done
# At most 8 files of 16 MiB come back: the four drafts (fp32, ~24 MB each) in 15 MB parts.
(cd "$W" && tar cf - seed*/eagle31.json seed*/*/checkpoints/final/draft seed*/*/checkpoints/final/trainer_state.json \
  seed*/*/metrics.jsonl | xz -1 -T8 | split -b 15M - "$OUT/drafts.tar.xz.part.")
ls -la "$OUT"
