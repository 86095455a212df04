#!/usr/bin/env bash
# What the S3 benchmarks (bench_object_store, its s3-latency mode, bench_verify) need on the lent GPU
# machine's CPUs that its image lacks (KINDS.md's list): hsstore's own needs (zarr, numcodecs, crc32c,
# pydantic, ...) and moto's server, s3fs, obstore, botocore with theirs, each at the version installed
# here (what the tests ran against), for its Python 3.12, unpacked into one site folder, trimmed and
# packed with xz into the ignored .gpu-s3/s3-site.tar.xz (~11 MB; the wheels are ~60 MB), beside
# .gpu-s3/setup.sh that unpacks it into /tmp/site. A call carries 64 MiB in all, the project tree
# (~52 MB with examples/reference-target) included, so the trimming is what lets it travel alone:
# botocore keeps the service models of s3 and sts (the other ~400 are 14 of its 16 MB), moto the
# packages its S3 server imports (of ~150 services), and the extensions lose their symbol tables
# (`strip --strip-unneeded`: numcodecs 35 -> 4 MB). Ray and the rest of ../shared/gpu's .gpu/ bundle
# are not needed.
#   bash tools/gpu_s3_wheels.sh
# then in a device call carrying [".gpu-s3"]:
#   bash .gpu-s3/setup.sh && export PYTHONPATH=/tmp/site:$PWD; python3 -m benchmarks.bench_object_store s3-latency ...
# PRUNED_CHECK=1 prunes this machine's botocore and moto as the bundle's are, and runs a small
# s3-latency benchmark and the S3 tests with them.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"  # shared by the worktrees
grep -qx '.gpu-s3/' "$exclude" 2>/dev/null || echo '.gpu-s3/' >> "$exclude"
packages="zarr numcodecs donfig crc32c google-crc32c pydantic pydantic-core annotated-types typing-inspection
moto flask flask-cors blinker itsdangerous werkzeug boto3 botocore s3transfer jmespath responses xmltodict
python-dateutil s3fs fsspec aiobotocore aioitertools obstore cryptography cffi pycparser"
keep_botocore='s3|sts'  # service models kept (botocore/data/<service>); its top-level JSON files stay too
# moto's packages that its S3 server imports (the others are its ~150 other services): found by
# listing sys.modules after writing, committing, uploading (multipart), reading, verifying and
# deleting through it, as the benchmarks and tests do.
keep_moto='backends|cloudwatch|core|events|iam|moto_api|moto_server|s3|s3bucket_path|sts|utilities'

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
installed() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

prune() {  # $1: a site folder holding botocore/ and moto/
  find "$1/botocore/data" -mindepth 1 -maxdepth 1 -type d | grep -Ev "/($keep_botocore)\$" | xargs rm -rf
  find "$1/moto" -mindepth 1 -maxdepth 1 -type d | grep -Ev "/($keep_moto)\$" | xargs rm -rf
}

if [ "${PRUNED_CHECK:-0}" = 1 ]; then
  # This machine's botocore and moto, pruned as the bundle's are, ahead of the installed ones.
  for name in botocore moto; do
    cp -r "$(python3 -c "import $name, os; print(os.path.dirname($name.__file__))")" "$tmp/$name"
  done
  prune "$tmp"
  PYTHONPATH="$tmp:$PWD" python3 -m benchmarks.bench_object_store s3-latency --hidden 256 --tokens 8192 \
    --repeats 1 --ceiling-threads 4 --latency-ms 5 --endpoint-processes 2
  PYTHONPATH="$tmp:$PWD" python3 -m pytest -q -p no:cacheprovider tests/support/test_s3.py tests/hsstore/test_object_store.py
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
prune "$tmp/site"
find "$tmp/site" -name '*.so*' -type f -exec strip --strip-unneeded {} +
tar -C "$tmp/site" -cf - . | xz -T0 -9 > .gpu-s3/s3-site.tar.xz
cat > .gpu-s3/setup.sh <<'SH'
#!/usr/bin/env bash
# On the GPU machine: unpack the S3 benchmarks' packages into /tmp/site (tools/gpu_s3_wheels.sh).
set -e
mkdir -p /tmp/site
tar xJf "$(dirname "$0")/s3-site.tar.xz" -C /tmp/site
SH
du -sh .gpu-s3/s3-site.tar.xz
