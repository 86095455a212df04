#!/usr/bin/env bash
# Wheels for running benchmarks/bench_object_store.py on the lent GPU machine's CPUs (issue 16):
# moto's server, s3fs and obstore are not in its image. Downloads, for its Python 3.12, the versions
# installed here of the packages the benchmark imports that the image lacks (KINDS.md's list), plus
# the .gpu/whl wheels (zarr, crc32c, pydantic, ...: build .gpu/ first), into the ignored .gpu-s3/whl.
#   bash tools/gpu_s3_wheels.sh        # ~45 MB; then, in a device call carrying [".gpu-s3"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-s3/whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.bench_object_store --tokens 98304 --endpoint-processes 8 --out $OUT/os.json
# (The tree with examples/reference-target's weights plus these is over a call's 64 MiB: move the
# weights out for the call and back after.) Checked here: a Python 3.12 venv holding only the image's
# packages that the benchmark imports (numpy, pyarrow, aiohttp, werkzeug, jinja2, click, packaging,
# requests, ...) plus these wheels runs `bench_object_store.py --quick --endpoint-processes 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '.gpu-s3/' .git/info/exclude 2>/dev/null || echo '.gpu-s3/' >> .git/info/exclude
dest=.gpu-s3/whl
mkdir -p "$dest"
packages="moto flask flask-cors blinker itsdangerous boto3 botocore s3transfer jmespath responses xmltodict
s3fs fsspec aiobotocore aioitertools obstore cryptography cffi pycparser"
for name in $packages; do
  version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "$name==$version"
done
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  cp .gpu/whl/*.whl "$dest"/
else
  echo "no .gpu/whl: run ../shared/gpu/make-bundle.sh and tools/gpu_bundle_extras.sh first" >&2
  exit 1
fi
du -sh "$dest"
