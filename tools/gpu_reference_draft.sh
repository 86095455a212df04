#!/usr/bin/env bash
# The reference draft's ladder (issue 28) on the lent H200, in two stages that each fit one
# 10-minute device call. Carry [".gpu/whl", ".gpu-data"]: hsstore's small wheels
# (../shared/gpu/make-bundle.sh; Ray is not needed: every job runs in process) and the prompt sets,
# built here (the GPU machine has another Python, hence other sources) and xz-packed:
#   python3 -m pipelines.generate.source_prompts --out runs/source-prompts.jsonl    (then head -n 14000:
#     the builder's last prompts are the ceiling's probe; 14,000 xz-packed fit the 64 MiB carry)
#   python3 -m pipelines.generate.source_prompts --out runs/source-raw.jsonl --human-answers 2000
#     (then only the records whose ids the generation answered: the same prompts on every rung)
#   mkdir -p .gpu-data && xz -9 -c runs/source-prompts.jsonl > .gpu-data/source-prompts.jsonl.xz (and source-raw)
#   RUNGS=greedy PARTS=2 GEN_BATCH=1024 BENCH_SECONDS=0 bash tools/gpu_reference_draft.sh generate
#   (bring the generated datasets back into .gpu-data/ as gen-*.tar.xz, then)
#   STEPS=3000 RUNGS="raw greedy" GREEDY_DATA=/tmp/reference-draft/gen-greedy-0,/tmp/reference-draft/gen-greedy-1 bash tools/gpu_reference_draft.sh train
#     (extract the rungs, train each at equal steps, export the newest step all reached)
# The whole ladder in one 10-minute call, on fewer prompts (LOG, 2026-12-05): with no prompt set
# carried, the generate stage builds this machine's (PROMPTS of them), and the train stage the raw
# records of the prompts the greedy generation answered:
#   export LADDER_DIR=$PWD/runs/ladder; PROMPTS=2000 RUNGS="greedy t1" PARTS=2 GEN_BATCH=512 \
#     GEN_SECONDS=200 BENCH_SECONDS=0 bash tools/gpu_reference_draft.sh generate
#   STEPS=1200 TRAIN_DEADLINE=330 RUNGS="raw greedy t1" GREEDY_DATA=$LADDER_DIR/gen-greedy-0,$LADDER_DIR/gen-greedy-1 \
#     T1_DATA=$LADDER_DIR/gen-t1-0,$LADDER_DIR/gen-t1-1 bash tools/gpu_reference_draft.sh train
# The labels' ladder (LOG, 2026-12-06): a rung "<data>-tokens" trains <data>'s store with the
# records' own next tokens as labels (`teacher: tokens`) instead of the target's distribution:
#   STEPS=1200 TRAIN_DEADLINE=480 RUNGS="raw greedy raw-tokens greedy-tokens" \
#     GREEDY_DATA=$LADDER_DIR/gen-greedy-0,$LADDER_DIR/gen-greedy-1 bash tools/gpu_reference_draft.sh train
# The acceptance lengths are then measured on the CPU (python3 -m benchmarks.bench_evaluate reference-draft).
# The ceiling against a raw-data draft (LOG, 2026-12-04), after `bench_evaluate ceiling --work W
# --stages probe,generate,extract` here:
#   mkdir -p .gpu-data && cp ../shared/data/reserved_sources.sha256 .gpu-data/
#   python3 -c "import json; print('\n'.join(json.loads(l)['id'] for l in open('W/probe.jsonl')))" > .gpu-data/probe-ids.txt
#   tar cJf .gpu-data/probe-generated.tar.xz -C W generated
#   STEPS=3000 bash tools/gpu_reference_draft.sh raw-ceiling     (carry .gpu/whl and .gpu-data; drafts.tgz comes back)
#   bench_evaluate ceiling --work W --stages decode,accuracy --raw-draft export-raw --ceiling-draft export-ceiling, then --report
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/reference-draft-out}
STEPS=${STEPS:-3000}
SECONDS=0
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# LADDER_DIR=runs/ladder (ignored by git, so kept in the device's checkout between two calls on a
# machine still warm) lets the train stage read what the generate stage wrote without carrying it.
W=${LADDER_DIR:-/tmp/reference-draft}
mkdir -p "$W"
for name in source-prompts source-raw; do
  [ -f "$W/$name.jsonl" ] || [ ! -f ".gpu-data/$name.jsonl.xz" ] || xz -dc ".gpu-data/$name.jsonl.xz" > "$W/$name.jsonl"
done
hs() { python3 -m pipelines.cli "$@"; }
# GEN_ARGS, TRAIN_ARGS, EXTRACT_ARGS: more `--set`s for every generate, train and extract command
# (e.g. a CPU rehearsal of the stages before a device call: benchmarks/LOG.md, 2026-12-05).
build_sources() {
  # This machine's own sources (its Python's standard library and packages) when no prompt set was
  # carried: ../shared does not travel, .gpu-data/reserved_sources.sha256 is its copy of the held-out
  # list (standard-library files are held out under every python3.X folder).
  local answers=$1 out=$2
  python3 -m pipelines.generate.source_prompts --out "$out" $answers \
    --reserved .gpu-data/reserved_sources.sha256 --eval examples/data/eval_prompts.jsonl | tail -n 3
}
case "$stage" in
  generate)
    # The 19M target leaves the H200 idle at batch 128: the rungs share it, with bigger batches.
    # RUNGS picks the rungs (default greedy and t1); PARTS > 1 splits the source prompts into that
    # many processes per rung (the decode loop is launch-bound: processes overlap its Python), each
    # writing gen-<rung>-<part>; GEN_BATCH sets the batch and the unit size.
    batch=${GEN_BATCH:-512}
    parts=${PARTS:-1}
    if [ ! -f "$W/source-prompts.jsonl" ]; then
      build_sources "" "$W/source-prompts-all.jsonl"
      head -n "${PROMPTS:-14000}" "$W/source-prompts-all.jsonl" > "$W/source-prompts.jsonl"
    fi
    split -n "l/$parts" -d -a 2 --additional-suffix=.jsonl "$W/source-prompts.jsonl" "$W/source-prompts.part"
    for rung in ${RUNGS:-greedy t1}; do
      temp=0.0; [ "$rung" = t1 ] && temp=1.0
      for (( part = 0; part < parts; part++ )); do
        name=gen-$rung; [ "$parts" -gt 1 ] && name=gen-$rung-$part
        data="$W/source-prompts.part$(printf %02d $part).jsonl"
        [ "$part" = 0 ] && data="examples/data/draft_train_slice.jsonl,$data"
        # SIGTERM at GEN_SECONDS: the units in flight commit (up to GEN_GRACE more seconds), then it stops
        timeout -k "${GEN_GRACE:-90}" "${GEN_SECONDS:-390}" python3 -m pipelines.cli generate recipes/reference/generate.yaml \
          --set "data=[$data]" --set "output=$W/$name" --set sampling.temperature=$temp \
          --set batching.max_batch_size=$batch --set batching.token_budget=$(( batch * 2048 )) \
          --set units.max_records=$batch ${GEN_ARGS:-} > "$OUT/generate-$name.log" 2>&1 &
      done
    done
    wait
    tail -n 12 "$OUT"/generate-*.log
    for out in "$W"/gen-*/; do name=$(basename "$out"); tar cJf "$OUT/$name.tar.xz" -C "$W" "$name"; done
    [ "${BENCH_SECONDS:-170}" = 0 ] || timeout "${BENCH_SECONDS:-170}" python3 -m benchmarks.bench_generate \
      --shape qwen3-8b --device cuda --out "$OUT/generate-h200.json" 2>&1 | tail -n 30 ;;
  train)
    # Each rung's data: by default the two generated datasets and the raw records (the bundled
    # slice and the source prompts with their files' own continuations); RAW_DATA, GREEDY_DATA and
    # T1_DATA (comma-separated) replace them, e.g. with a subset every rung shares; the mixed rung
    # reads the raw and the greedy data together.
    for pack in .gpu-data/*.tar.xz; do [ -f "$pack" ] && tar xJf "$pack" -C "$W"; done
    for packed in .gpu-data/*.jsonl.xz; do
      [ -f "$packed" ] && xz -dc "$packed" > "$W/$(basename "$packed" .xz)"
    done
    rungs=${RUNGS:-raw greedy t1}
    # A rung <data>-tokens trains on <data>'s store with `teacher: tokens` (the records' own next
    # tokens as labels, not the target's distribution): one store per data, extracted once.
    stores=" $(for rung in $rungs; do echo "${rung%-tokens}"; done | sort -u | tr '\n' ' ')"
    if [ ! -f "$W/source-raw.jsonl" ] && [[ "$stores" == *" raw "* ]]; then
      # The raw rung: the prompts the greedy generation answered, each with its file's own text.
      build_sources "--human-answers 2000" "$W/source-raw-all.jsonl"
      python3 - "$W" <<'PY'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
answered = {json.loads(line)["id"] for shard in w.glob("gen-greedy*/shards/*.jsonl")
            for line in shard.read_text(encoding="utf-8").splitlines()}
lines = (w / "source-raw-all.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
kept = [line for line in lines if json.loads(line)["id"] in answered]
(w / "source-raw.jsonl").write_text("".join(kept), encoding="utf-8")
print(f"raw rung: {len(kept)} records, the source prompts the greedy generation answered")
PY
    fi
    declare -A data=(
      [raw]="${RAW_DATA:-examples/data/draft_train_slice.jsonl,$W/source-raw.jsonl}"
      [greedy]="${GREEDY_DATA:-$W/gen-greedy}" [t1]="${T1_DATA:-$W/gen-t1}"
    )
    data[mixed]="${data[raw]},${data[greedy]}"  # every prompt twice: its file's text and the target's answer
    for name in $stores; do
      hs extract recipes/reference/extract.yaml --set "data=[${data[$name]}]" --set "store=$W/store-$name" \
        --set executor=local --set allow_unfinished_generation=true ${EXTRACT_ARGS:-} > "$OUT/extract-$name.log" 2>&1 &
    done
    wait
    tail -n 6 "$OUT"/extract-*.log
    df -h "$W" | tail -1
    # The rungs share the GPU (the 1-layer draft leaves it mostly idle); a time guard keeps the
    # call inside its limit, and the export then takes the newest step that every rung reached
    # (equal steps), from checkpoints every 250 steps, all kept.
    for rung in $rungs; do
      teacher=auto; [ "$rung" != "${rung%-tokens}" ] && teacher=tokens
      timeout $(( ${TRAIN_DEADLINE:-520} - SECONDS )) python3 -m pipelines.cli train \
        recipes/reference/train-reference-draft.yaml --set "store=$W/store-${rung%-tokens}" \
        --set "output_dir=$W/draft-$rung" --set "max_steps=$STEPS" --set checkpoint_every=250 \
        --set keep_checkpoints=1000 --set teacher=$teacher ${TRAIN_ARGS:-} > "$OUT/train-$rung.log" 2>&1 &
    done
    wait
    common=$STEPS
    for rung in $rungs; do
      tail -n 3 "$OUT/train-$rung.log"
      reached=$STEPS
      [ -d "$W/draft-$rung/checkpoints/final" ] || \
        reached=$(ls -d "$W/draft-$rung"/checkpoints/step_* | sed 's/.*step_0*//' | sort -n | tail -1)
      [ "${reached:-0}" -lt "$common" ] && common=$reached
    done
    echo "exporting step $common of every rung"
    for rung in $rungs; do
      checkpoint="$W/draft-$rung/checkpoints/final"
      [ "$common" = "$STEPS" ] && [ -d "$checkpoint" ] || \
        checkpoint=$(ls -d "$W/draft-$rung"/checkpoints/step_* | grep -E "step_0*$common\$")
      hs export "$checkpoint" --format eagle3 --out "$W/export-$rung" --overwrite
      echo "$checkpoint" > "$W/export-$rung/checkpoint.txt"
      cp "$W/draft-$rung/metrics.jsonl" "$W/export-$rung/" 2>/dev/null
      hs info "$W/store-${rung%-tokens}" > "$W/export-$rung/store-info.txt" 2>&1
    done
    # Two exports a file (~5 MB each): a file that comes back from a device call holds at most 16 MiB.
    set -- $rungs; part=0
    while [ $# -gt 0 ]; do
      pair="export-$1"; shift; [ $# -gt 0 ] && { pair="$pair export-$1"; shift; }
      part=$(( part + 1 )); (cd "$W" && tar czf "$OUT/drafts-$part.tgz" $pair)
    done ;;
  raw-ceiling)
    # The two drafts the acceptance ceiling is compared with, in one call (LOG, 2026-12-04):
    # - the raw rung, rebuilt by the ladder's recipe: the prompts the greedy generation answered (the
    #   builder's first 14,000 prompts split in two by the generate stage's `split`, the first 4,096
    #   records of each, the bundled slice's 160 first), each answered by its file's own text; none
    #   of the probe's files (.gpu-data/probe-ids.txt). From this machine's sources, or RAW_XZ: the
    #   raw records chosen elsewhere the same way (e.g. on the VM whose packages the probe's files
    #   come from);
    # - the ceiling (CEILING=0: skipped): `bench_evaluate ceiling --stages extract,train` on this GPU,
    #   over the probe's greedy answers (.gpu-data/probe-generated.tar.xz, from its probe and
    #   generate stages on the VM), so its settings are the benchmark's own.
    # ../shared does not travel: .gpu-data/reserved_sources.sha256 is its copy (examples/data/eval_prompts.jsonl
    # is the same file as its eval_prompts.jsonl).
    mkdir -p "$W/ceiling" && tar xJf .gpu-data/probe-generated.tar.xz -C "$W/ceiling"
    if [ -n "${RAW_XZ:-}" ]; then xz -dc "$RAW_XZ" > "$W/source-raw.jsonl"; else
      build_sources "" "$W/source-prompts-all.jsonl"
      build_sources "--human-answers 2000" "$W/source-raw-all.jsonl"
      head -n 14000 "$W/source-prompts-all.jsonl" > "$W/source-prompts-first.jsonl"
      split -n l/2 -d -a 2 --additional-suffix=.jsonl "$W/source-prompts-first.jsonl" "$W/source-prompts-first.part"
      { head -n $(( 4096 - 160 )) "$W/source-prompts-first.part00.jsonl"; head -n 4096 "$W/source-prompts-first.part01.jsonl"; } \
        > "$W/source-prompts-answered.jsonl"
      python3 - "$W" <<'PY'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
ids = lambda path: [json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines()]
answered = set(ids(w / "source-prompts-answered.jsonl")) - set(Path(".gpu-data/probe-ids.txt").read_text().split())
lines = (w / "source-raw-all.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
kept = [line for line in lines if json.loads(line)["id"] in answered]
(w / "source-raw.jsonl").write_text("".join(kept), encoding="utf-8")
print(f"raw rung: {len(kept)} records, the prompts the generation would have answered")
PY
    fi
    ( hs extract recipes/reference/extract.yaml --set "data=[examples/data/draft_train_slice.jsonl,$W/source-raw.jsonl]" \
        --set "store=$W/store-raw" --set executor=local > "$OUT/extract-raw.log" 2>&1 &&
      timeout $(( ${TRAIN_DEADLINE:-540} - SECONDS )) python3 -m pipelines.cli train recipes/reference/train-reference-draft.yaml \
        --set "store=$W/store-raw" --set "output_dir=$W/draft-raw" --set "max_steps=$STEPS" \
        --set checkpoint_every=250 --set keep_checkpoints=1000 > "$OUT/train-raw.log" 2>&1 ) &
    [ "${CEILING:-1}" = 0 ] || python3 -m benchmarks.bench_evaluate ceiling --work "$W/ceiling" --stages extract,train \
      --train-device cuda > "$OUT/train-ceiling.log" 2>&1 &
    wait
    tail -n 4 "$OUT"/extract-raw.log "$OUT"/train-*.log
    names="raw ceiling"; [ "${CEILING:-1}" = 0 ] && names=raw
    for name in $names; do
      run="$W/draft-$name"; [ "$name" = ceiling ] && run="$W/ceiling/draft-ceiling"
      checkpoint="$run/checkpoints/final"
      [ -d "$checkpoint" ] || checkpoint=$(ls -d "$run"/checkpoints/step_* | sort | tail -1)
      hs export "$checkpoint" --format eagle3 --out "$W/export-$name" --overwrite
      echo "$checkpoint" > "$W/export-$name/checkpoint.txt"
      cp "$run/metrics.jsonl" "$W/export-$name/"
    done
    hs info "$W/store-raw" > "$W/export-raw/store-info.txt" 2>&1
    (cd "$W" && tar czf "$OUT/drafts.tgz" $(for name in $names; do echo "export-$name"; done)) ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
