#!/usr/bin/env bash
# Wheels for running SpecForge 0.2.0's offline EAGLE-3 trainer (benchmarks/specforge/peer.py) on the
# lent GPU machine, whose image (KINDS.md's package list: torch 2.11, triton 3.6, transformers 5.17,
# accelerate, pyyaml, safetensors, huggingface-hub, numpy, pandas, pyarrow, xxhash, fsspec, tqdm,
# psutil) lacks what SpecForge's offline path imports beyond it:
#   specforge 0.2.0 itself (--no-deps: its sglang/torch pins are not needed offline),
#   datasets (imported at module level by specforge/data/utils.py, the offline collator's module)
#     and its dill + multiprocess,
#   pydantic (specforge/config/schema.py) + pydantic-core, annotated-types, typing-inspection:
#     only when .gpu/whl (hsstore's own bundle, ../shared/gpu/make-bundle.sh) does not already hold
#     them, since two versions of one package stop the whole install.
# Found by recording every module a CPU run of `specforge train` imported (boto3, httpx2, trio and
# dill-through-torch are optional imports of accelerate/huggingface_hub/torch, not needed there).
#   bash tools/specforge_gpu_wheels.sh      # -> .gpu-specforge/whl (3.7 MB with the pydantic wheels, 1.3 MB without)
# Then, in a device call carrying [".gpu", ".gpu-specforge"] (or only .gpu-specforge):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .gpu-specforge/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 -c "import specforge.cli, specforge.core.loss, datasets; print('specforge ok')"
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu-specforge/' "$exclude" 2>/dev/null || echo '/.gpu-specforge/' >> "$exclude"
dest=.gpu-specforge/whl
rm -rf "$dest" && mkdir -p "$dest"
py=${PYVER:-3.12}
wheel=${SPECFORGE_WHEEL:-/tmp/peers/specforge-0.2.0-py3-none-any.whl}
[ -f "$wheel" ] || { echo "no SpecForge wheel at $wheel (set SPECFORGE_WHEEL)" >&2; exit 1; }
cp "$wheel" "$dest"/
# datasets 5.1 accepts the image's huggingface-hub 1.33 (>=1.31,<3); dill/multiprocess in its range.
packages="datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19"
if ! ls .gpu/whl/pydantic-2*.whl >/dev/null 2>&1; then
  packages="$packages pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2"
fi
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" $packages
ls -1 "$dest"
du -sh "$dest"
