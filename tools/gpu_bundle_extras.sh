#!/usr/bin/env bash
# Adjust .gpu/whl (built by ../shared/gpu/make-bundle.sh, which is shared and read-only here) to what
# hsstore runs on: add `crc32c` (hsstore/checksum.py), which that script does not list, and replace
# its zarr (the newest; zarr 3.2+ imports msgspec, which the bundle lacks) with the version installed
# here, the one the tests ran against. Run from the project root after make-bundle.sh;
# .gpu/setup.sh installs every wheel in .gpu/whl on the GPU machine.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .gpu/whl ] || { echo "no .gpu/whl: run ../shared/gpu/make-bundle.sh first" >&2; exit 1; }
py=${PYVER:-3.12}
installed() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
crc32c_version=$(installed crc32c)
zarr_version=$(installed zarr)
rm -f .gpu/whl/zarr-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  -d .gpu/whl "crc32c==$crc32c_version" "zarr==$zarr_version"
ls .gpu/whl | grep -E '^(crc32c|zarr)-'
