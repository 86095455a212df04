#!/usr/bin/env bash
# What the S3 benchmarks (bench_object_store, its s3-latency mode, bench_verify) need on the lent GPU
# machine's CPUs beyond the .gpu/ bundle (../shared/gpu/make-bundle.sh: zarr, pydantic, crc32c, Ray):
# moto's server, s3fs, obstore, botocore and their dependencies that the image lacks (KINDS.md's list),
# each at the version installed here (what the tests ran against), for its Python 3.12, unpacked into
# one site folder and packed with xz into the ignored .gpu-s3/s3-site.tar.xz (~14 MB). botocore keeps
# only the service models S3 needs (s3, sts): its other ~400 services are 14 of its 16 MB, and a call
# carries 64 MiB in all, the project tree included.
#   bash tools/gpu_s3_wheels.sh
# then in a device call carrying [".gpu", ".gpu-s3"] (examples/reference-target's weights moved out
# of the tree for the call: with them the tree alone is 43 MiB):
#   bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD; tar xJf .gpu-s3/s3-site.tar.xz -C /tmp/site && \
#   python3 -m benchmarks.bench_object_store s3-latency --endpoint-processes 8 --out $OUT/s3-latency.json
# Checked here: the benchmark and its moto server run with this botocore (BOTOCORE_ONLY_CHECK=1 below
# builds the pruned botocore for this machine's Python and runs the quick benchmark against it).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"  # shared by the worktrees
grep -qx '.gpu-s3/' "$exclude" 2>/dev/null || echo '.gpu-s3/' >> "$exclude"
packages="moto flask flask-cors blinker itsdangerous werkzeug boto3 botocore s3transfer jmespath responses xmltodict
python-dateutil s3fs fsspec aiobotocore aioitertools obstore cryptography cffi pycparser"
keep_botocore='s3|sts'  # service models kept (botocore/data/<service>); its top-level JSON files stay too
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
installed() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

prune_botocore() {  # $1: a site folder holding botocore/
  find "$1/botocore/data" -mindepth 1 -maxdepth 1 -type d | grep -Ev "/($keep_botocore)\$" | xargs rm -rf
}

if [ "${BOTOCORE_ONLY_CHECK:-0}" = 1 ]; then
  # This machine's botocore, pruned as the bundle's is, ahead of the installed one on PYTHONPATH.
  cp -r "$(python3 -c 'import botocore, os; print(os.path.dirname(botocore.__file__))')" "$tmp/botocore"
  prune_botocore "$tmp"
  PYTHONPATH="$tmp:$PWD" python3 -m benchmarks.bench_object_store s3-latency --hidden 256 --tokens 8192 \
    --repeats 1 --ceiling-threads 4 --latency-ms 5 --endpoint-processes 2
  exit
fi

mkdir -p "$tmp/whl" "$tmp/site" .gpu-s3
for name in $packages; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp/whl" "$name==$(installed "$name")"
done
for wheel in "$tmp"/whl/*.whl; do
  python3 -m zipfile -e "$wheel" "$tmp/site"
done
prune_botocore "$tmp/site"
tar -C "$tmp/site" -cf - . | xz -T0 -9 > .gpu-s3/s3-site.tar.xz
du -sh .gpu-s3/s3-site.tar.xz
