#!/usr/bin/env bash
# The lent-H200 benchmark session, in stages (each fits one 10-minute device call).
#   bash tools/gpu_session.sh setup-and-extract   # reference store + trained draft + bench_extract
#   bash tools/gpu_session.sh write-extract-train # shard writes, bench_extract, bench_train
#   DRAFT=... bash tools/gpu_session.sh evaluate  # bench_evaluate + GPU tests
#   bash tools/gpu_session.sh extract-ray         # issue 13 + 16.3 on nvidia-h200-x2 (~8 min)
#   bash tools/gpu_session.sh gpu-limit-extract   # issue 31 parts 1-2 on nvidia-h200 (~6-7 min)
#   bash tools/gpu_session.sh gpu-limit-bytecode-ab  # issue 31: the job wall with and without bytecode (~8 min)
#   bash tools/gpu_session.sh gpu-limit-planning-ab  # issue 31: the tokenizer pool's early start, A/B (~7 min)
#   bash tools/gpu_session.sh gpu-limit-train-teacher-ab  # issue 31: the step, teacher once vs per depth (~8 min)
# The first three expect wheels for the packages the GPU image lacks in .whl/ (zarr, numcodecs,
# pydantic, ...) and the training data gzipped at .bench/draft_train.jsonl.gz (../shared does not
# travel); they run extraction in process (executor=local). extract-ray uses the .gpu/ bundle
# (../shared/gpu/make-bundle.sh: Ray, zarr, pydantic, ...) and runs extraction through Ray; it needs
# neither examples/reference-target nor .bench/ (it builds its 8B-shape model and data on the box).
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/hsstore-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$stage" = extract-ray ] || [ "${stage#gpu-limit-}" != "$stage" ]; then
  # .gpu/ from ../shared/gpu/make-bundle.sh plus tools/gpu_bundle_extras.sh (crc32c, zarr pinned).
  bash .gpu/setup.sh || exit 1
  # --upgrade: a warm machine keeps /tmp/site from an earlier call (an older bundle's zarr).
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/whl/crc32c-*.whl .gpu/whl/zarr-*.whl 2>/dev/null
  PYTHONPATH=/tmp/site python3 -c 'import crc32c, zarr' || { echo "bundle incomplete: run tools/gpu_bundle_extras.sh" >&2; exit 1; }
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
WORK=/tmp/hsstore-work
mkdir -p "$WORK"
hs() { python3 -m pipelines.cli "$@"; }
# Bytecode for what a job imports (the environment's site-packages, the bundle, the repository), as
# `pip install` leaves it: the lent machine forbids writing it, and its torch, numpy and sympy ship
# none (tools/pyc_census.py), so without this every process compiles them (~6-10 s on 16 cores).
# (compileall writes despite PYTHONDONTWRITEBYTECODE: the variable only stops imports.)
compile_bytecode() {
  local site
  site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  { time python3 -m compileall -q -j 0 "$site" /tmp/site hsstore pipelines benchmarks > /dev/null; } 2>&1 | tail -n 3
}

case "$stage" in
setup-and-extract)
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)'; nproc; } | tee "$OUT/machine.txt"
  gunzip -c .bench/draft_train.jsonl.gz > "$WORK/draft_train.jsonl"
  time hs extract recipes/reference/extract.yaml --set "data=[$WORK/draft_train.jsonl]" --set executor=local \
      --set "store=$WORK/ref-store" --set model.device=cuda 2>&1 | tail -n 14 | tee "$OUT/extract.txt"
  time hs train recipes/reference/train-eagle3.yaml --set "store=$WORK/ref-store" --set "output_dir=$WORK/ref-eagle3" \
      --set device=cuda --set log_every=50 2>&1 | grep -v "^train draft" | tail -n 6 | tee "$OUT/train.txt"
  hs export "$WORK/ref-eagle3/checkpoints/final" --format eagle3 --out "$OUT/export-eagle3" 2>&1 | tail -n 2
  tail -n 3 "$WORK/ref-eagle3/metrics.jsonl" > "$OUT/train_metrics_tail.jsonl"
  python3 -m benchmarks.bench_extract --models reference,qwen3-8b --out "$OUT/bench_extract.json" 2>&1 | tail -n 30
  ;;
write-extract-train)
  mkdir -p "$WORK/write" "$WORK/extract"
  [ -f "$WORK/draft_train.jsonl" ] || gunzip -c .bench/draft_train.jsonl.gz > "$WORK/draft_train.jsonl"
  export HSSTORE_TRAIN_DATA="$WORK/draft_train.jsonl"
  python3 -m benchmarks.bench_store shard-write --hidden 4096 --tokens 65536 --shard-chunks 0 64 --repeats 1 --dir "$WORK/write" --out "$OUT/bench_shard_write.json" 2>&1 | tail -n 8
  python3 -m benchmarks.bench_extract --models ${EXTRACT_MODELS:-reference,qwen3-8b} --store-dir "$WORK/extract" --out "$OUT/bench_extract.json" 2>&1 | tail -n 6
  python3 -m benchmarks.bench_train --device cuda ${TRAIN_ARGS:-} --out "$OUT/bench_train.json" 2>&1 | tail -n 30
  ;;
evaluate)
  python3 -m benchmarks.bench_evaluate --draft "${DRAFT:?}" --device cuda --prompts "${PROMPTS:-examples/data/eval_prompts.jsonl}" \
      ${EVAL_ARGS:-} --out "$OUT/bench_evaluate_h200.json" 2>&1 | tail -n 30
  python3 -m pytest -q -m gpu tests 2>&1 | tail -n 5
  ;;
extract-ray)
  # Bare forward vs `hsstore extract` through Ray (1 and 2 actors, bf16 and fp8) and the Qwen3-8B
  # shape split over 2 GPUs by one actor; writes $OUT/extract-h200.json and $OUT/split-target.json.
  # EXTRACT_RAY_ARGS="--tokens 800000" shortens it (default 1.2M tokens; ~7 min on 2 H200s, no
  # step starts after 400 s of benchmark; the JSON is rewritten after each step).
  # The 2.4M tokens take two calls (each prepares and runs the bare forward again), with
  # units small enough that 2 actors get nearly equal shares (37 units of 65,536 tokens, not 10):
  #   EXTRACT_RAY_ARGS="--tokens 2400000 --unit-tokens 65536 --runs bf16-1,fp8-1 --deadline-s 420"
  #   EXTRACT_RAY_ARGS="--tokens 2400000 --unit-tokens 65536 --runs bf16-2,fp8-2,split --deadline-s 420"
  # (nvidia-h200 has a 64 GiB disk: a bf16 store of 2.4M tokens at H=4096 is 79 GB; use <= 1.3M there.)
  # Ray against in process in one call, the bare forward before and after (RESULTS.md, 08:17 UTC):
  #   EXTRACT_RAY_ARGS="--gpus 1 --split-gpus 1 --tokens 1300000 --runs bf16-1,bf16-1-local --bare-after"
  # Why the CLI path (93-94% of bare) trails bench_extract.py's in-process ABBA (96.7-97.0%): run the
  # latter on the CLI's batch plan (length-sorted windows) in the same call, e.g. before the above:
  #   python3 -m benchmarks.bench_extract --models qwen3-8b --codec bf16 --no-attention-mask \
  #       --tokens 786432 --repeats 2 --gpu-timeline --sort-window-tokens 4194304 --out $OUT/abba-sorted.json
  # (11:09 UTC: 95.0% with sorted batches; the forwards' excess was the copies' burst, now paced.)
  # What a copy beside a forward costs it, variant by variant (RESULTS.md, 11:18-11:50 UTC):
  #   python3 -m benchmarks.investigations.profile_copy_contention --cycles 7 --out $OUT/copy-contention.json
  # The bare forward between the runs (each run against the bare passes beside it; RESULTS.md,
  # 18:00-18:33 UTC: the gap was a fixed ~1.5 s per run before the GPU's first forward; /dev/shm
  # made no difference). After the compute-thread and warm-up changes, check gpu_head_seconds, and
  # read the traced run's first batches (profiler.dir; $OUT/traces) with bench_extract's trace mode:
  #   EXTRACT_RAY_ARGS="--gpus 1 --split-gpus 1 --tokens 1000000 --disk-gib 1 --deadline-s 430 --sequence bare,fp8-1,bare,bf16-1,bare,fp8-1-trace"
  #   then, here: python3 -m benchmarks.bench_extract trace <files_at>/traces/extract-*.pt.trace.json.gz
  # At the issue's 2.4M tokens, fp8 only on one H200 (its store is ~39 GB; bf16's 79 GB does not fit
  # the 64 GiB disk), where a fixed ~1.5 s per run weighs 2% instead of 5%:
  #   EXTRACT_RAY_ARGS="--gpus 1 --split-gpus 1 --tokens 2400000 --disk-gib 1 --deadline-s 430 --sequence bare,fp8-1,bare"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)'; nproc; df -h /tmp | tail -n 1; } | tee "$OUT/machine.txt"
  python3 -m benchmarks.bench_extract ray run --out "$OUT" --work /tmp/hsstore-work/extract-ray ${EXTRACT_RAY_ARGS:-} 2>&1 | tail -n 40
  # The GPU-marked tests of this work (GPU fp8 encode == CPU bits, the pinned pool, a 2-GPU split).
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/hsstore/test_codecs_encode_torch.py tests/pipelines/extract/test_sink.py tests/pipelines/extract/test_warm_up.py tests/pipelines/extract/test_placement.py 2>&1 | tail -n 4 | tee "$OUT/gpu-tests.txt"
  ;;
gpu-limit-extract)
  # Issue 31 (parts 1-2) on one H200: the bare HF forward, `hsstore extract` through Ray eager and
  # compiled (model.compile), compiled vs eager features on the same batches, the start of a ~1M-token
  # job (model load, first forward, job wall); writes $OUT/gpu-limit-extract.json. Then, here:
  #   python -m benchmarks.bench_extract gpu-limit report <files_at>/gpu-limit-extract.json --write
  # GPU_LIMIT_ARGS="--tokens 600000" shortens it; no step starts after 420 s of benchmark.
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)'; nproc; df -h /tmp | tail -n 1; } | tee "$OUT/machine.txt"
  # BYTECODE=1: compile_bytecode first (above: what a user's install already has).
  [ -z "${BYTECODE:-}" ] || compile_bytecode
  python3 -m benchmarks.bench_extract gpu-limit run --out "$OUT" ${GPU_LIMIT_ARGS:-} 2>&1 | tail -n 40
  ;;
gpu-limit-bytecode-ab)
  # Issue 31's job wall with and without bytecode for what the job imports, one call (~8 min).
  # The lent machine sets PYTHONDONTWRITEBYTECODE=1 and its torch, numpy (and the bundle) carry no
  # .pyc at all, so every process compiles them from source at import; a user's `pip install`
  # leaves bytecode. Runs of the default configuration (compiled in the background, in process):
  # `source1` (after `prepare` wrote the 16 GB model: its writeback may still run), `source2` (the
  # machine as lent), then compileall over the environment's site-packages, the bundle and the
  # repository, and `bytecode`. The model and records are prepared once (same --work).
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)'; nproc; env | grep '^PYTHON' ; } | tee "$OUT/machine.txt"
  python3 tools/pyc_census.py torch transformers numpy sympy scipy sklearn safetensors tokenizers ray zarr pydantic | tee "$OUT/pyc-census.txt"
  python3 -X importtime -c 'import torch; from transformers import AutoModelForCausalLM' 2> "$OUT/importtime-source.txt"
  for run in source1 source2; do
    python3 -m benchmarks.bench_extract gpu-limit run --runs default --out "$OUT/$run" --deadline-s 200 ${GPU_LIMIT_ARGS:-} 2>&1 | grep -v '^ \|^{\|^}'
    sync
  done
  compile_bytecode
  python3 tools/pyc_census.py torch numpy sympy | tee -a "$OUT/pyc-census.txt"
  python3 -X importtime -c 'import torch; from transformers import AutoModelForCausalLM' 2> "$OUT/importtime-bytecode.txt"
  python3 -m benchmarks.bench_extract gpu-limit run --runs default --out "$OUT/bytecode" --deadline-s 200 ${GPU_LIMIT_ARGS:-} 2>&1 | grep -v '^ \|^{\|^}'
  ;;
gpu-limit-planning-ab)
  # Issue 31's start: the tokenizer pool started early and closed without waiting (after) against
  # the code before (before), the default run (compiled in the background, in process) alternated
  # twice, with bytecode for the whole environment first (see gpu-limit-bytecode-ab). Expects both
  # versions of pipelines/extract/tokenizer_pool.py in .gpu-ab/ (carried; ~7 min).
  compile_bytecode
  for round in 1 2; do
    for version in after before; do
      cp ".gpu-ab/tokenizer_pool_$version.py" pipelines/extract/tokenizer_pool.py
      python3 -m compileall -q pipelines/extract/tokenizer_pool.py > /dev/null
      python3 -m benchmarks.bench_extract gpu-limit run --runs default --skip-bare --out "$OUT/$version$round" --deadline-s 200 ${GPU_LIMIT_ARGS:-} 2>&1 | grep -v '^ \|^{\|^}'
    done
  done
  cp .gpu-ab/tokenizer_pool_after.py pipelines/extract/tokenizer_pool.py
  ;;
gpu-limit-train-teacher-ab)
  # Issue 31's training step: the teacher's logits once a step (today) against per depth
  # (`+perdepth`, the code before 2026-12-05), alternated, in child processes of one call, then the
  # FP8 step beside them (~8 min; carry .gpu, nothing else: the step is synthetic).
  compile_bytecode
  python3 -m benchmarks.bench_train step-modes --part throughput --deadline-s 540 --variant-budget-s 150 \
    --variants flex+graph flex+graph+perdepth flex+step+fp8 flex+graph+perdepth flex+graph \
    --out "$OUT/gpu-limit-h200.json" 2>&1 | tail -n 40
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
