#!/usr/bin/env bash
# The reference draft's ladder (issue 28) on the lent H200, in two stages that each fit one
# 10-minute device call. Carry [".gpu/whl", ".gpu-data"]: hsstore's small wheels
# (../shared/gpu/make-bundle.sh; Ray is not needed: every job runs in process) and the prompt sets,
# built here (the GPU machine has another Python, hence other sources) and xz-packed:
#   python3 -m pipelines.generate.source_prompts --out runs/source-prompts.jsonl --max-files 4000
#   python3 -m pipelines.generate.source_prompts --out runs/source-raw.jsonl --max-files 4000 --human-answers 2000
#   mkdir -p .gpu-data && xz -9 -c runs/source-prompts.jsonl > .gpu-data/source-prompts.jsonl.xz (and source-raw)
#   bash tools/gpu_reference_draft.sh generate   # greedy and T=1 answers side by side, then generate-h200.json
#   (bring the two generated datasets back into .gpu-data/, then)
#   bash tools/gpu_reference_draft.sh train      # extract the three rungs, train each at equal steps, export
# The acceptance lengths are then measured on the CPU (python3 -m benchmarks.bench_evaluate reference-draft).
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/reference-draft-out}
STEPS=${STEPS:-1500}
SECONDS=0
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/reference-draft
mkdir -p "$W"
for name in source-prompts source-raw; do
  [ -f "$W/$name.jsonl" ] || [ ! -f ".gpu-data/$name.jsonl.xz" ] || xz -dc ".gpu-data/$name.jsonl.xz" > "$W/$name.jsonl"
done
hs() { python3 -m pipelines.cli "$@"; }
case "$stage" in
  generate)
    # The 19M target leaves the H200 idle at batch 128: both rungs share it, with bigger batches.
    for rung in greedy t1; do
      temp=0.0; [ "$rung" = t1 ] && temp=1.0
      timeout "${GEN_SECONDS:-390}" python3 -m pipelines.cli generate recipes/reference/generate.yaml \
        --set "data=[examples/data/draft_train_slice.jsonl,$W/source-prompts.jsonl]" \
        --set "output=$W/gen-$rung" --set sampling.temperature=$temp \
        --set batching.max_batch_size=512 --set batching.token_budget=1048576 --set units.max_records=512 \
        > "$OUT/generate-$rung.log" 2>&1 &
    done
    wait
    tail -n 12 "$OUT"/generate-*.log
    for rung in greedy t1; do tar cJf "$OUT/gen-$rung.tar.xz" -C "$W" "gen-$rung"; done
    timeout "${BENCH_SECONDS:-170}" python3 -m benchmarks.bench_generate --shape qwen3-8b --device cuda \
      --out "$OUT/generate-h200.json" 2>&1 | tail -n 30 ;;
  train)
    # Each rung's data: by default the two generated datasets and the raw records (the bundled
    # slice and the source prompts with their files' own continuations); RAW_DATA, GREEDY_DATA and
    # T1_DATA (comma-separated) replace them, e.g. with a subset every rung shares.
    for pack in .gpu-data/*.tar.xz; do [ -f "$pack" ] && tar xJf "$pack" -C "$W"; done
    for packed in .gpu-data/*.jsonl.xz; do
      [ -f "$packed" ] && xz -dc "$packed" > "$W/$(basename "$packed" .xz)"
    done
    declare -A data=(
      [raw]="${RAW_DATA:-examples/data/draft_train_slice.jsonl,$W/source-raw.jsonl}"
      [greedy]="${GREEDY_DATA:-$W/gen-greedy}" [t1]="${T1_DATA:-$W/gen-t1}"
    )
    for rung in raw greedy t1; do
      hs extract recipes/reference/extract.yaml --set "data=[${data[$rung]}]" --set "store=$W/store-$rung" \
        --set executor=local > "$OUT/extract-$rung.log" 2>&1 &
    done
    wait
    tail -n 6 "$OUT"/extract-*.log
    # The three share the GPU (the 1-layer draft leaves it mostly idle); a time guard keeps the
    # call inside its limit, and the export then takes the newest checkpoint all three reached.
    for rung in raw greedy t1; do
      timeout $(( ${TRAIN_DEADLINE:-520} - SECONDS )) python3 -m pipelines.cli train \
        recipes/reference/train-reference-draft.yaml --set "store=$W/store-$rung" \
        --set "output_dir=$W/draft-$rung" --set "max_steps=$STEPS" --set checkpoint_every=250 \
        > "$OUT/train-$rung.log" 2>&1 &
    done
    wait
    for rung in raw greedy t1; do
      tail -n 3 "$OUT/train-$rung.log"
      checkpoint="$W/draft-$rung/checkpoints/final"
      [ -d "$checkpoint" ] || checkpoint=$(ls -d "$W/draft-$rung"/checkpoints/step_* | sort -t_ -k2 -n | tail -1)
      hs export "$checkpoint" --format eagle3 --out "$W/export-$rung" --overwrite
      echo "$checkpoint" > "$W/export-$rung/checkpoint.txt"
      cp "$W/draft-$rung/metrics.jsonl" "$W/export-$rung/" 2>/dev/null
      hs info "$W/store-$rung" > "$W/export-$rung/store-info.txt" 2>&1
    done
    tar czf "$OUT/drafts.tgz" -C "$W" export-raw export-greedy export-t1 ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
