#!/usr/bin/env bash
# Add to .gpu/whl the wheels hsstore needs beyond ../shared/gpu/make-bundle.sh's list (that script
# is shared and read-only here): today `crc32c` (hsstore/checksum.py). Run from the project root
# after make-bundle.sh; .gpu/setup.sh installs every wheel in .gpu/whl on the GPU machine.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .gpu/whl ] || { echo "no .gpu/whl: run ../shared/gpu/make-bundle.sh first" >&2; exit 1; }
py=${PYVER:-3.12}
version=$(python3 -c 'import importlib.metadata as m; print(m.version("crc32c"))')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  -d .gpu/whl "crc32c==$version"
ls .gpu/whl | grep '^crc32c-'
