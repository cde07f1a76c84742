#!/usr/bin/env bash
# Wheels that a GPU machine without a package index needs beside its own PyTorch / Triton / accelerate /
# pandas / matplotlib to run benchmarks/gpu_check.sh (the package at this repository's versions, the recipes'
# field libraries). Run here, where pip reaches PyPI; the GPU machine installs them with
#   WHEELS=.whl PYTHON=python3 bash benchmarks/gpu_check.sh   (which runs, before its checks:)
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
# The versions are the ones this repository's .venv holds (pip show); PY_VERSION is the GPU machine's Python.
#   benchmarks/gpu_wheels.sh            # into .whl/ (ignored by git: .git/info/exclude)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_VERSION=${PY_VERSION:-3.12}
DEST=${DEST:-.whl}
VENV_PY=${VENV_PY:-.venv/bin/python}
# timm (the package needs >= 1.0.26), webdataset (image shards), trimesh and pypcd4 (PCN), and what they need
# that such a machine lacks
NAMES=(timm webdataset braceexpand trimesh pypcd4 python-neo-lzf pydantic pydantic-core annotated-types
       typing-inspection)
mkdir -p "$DEST"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
specs=()
for name in "${NAMES[@]}"; do
  version=$("$VENV_PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in $VENV_PY (run ./run.sh test once)" >&2; exit 1; }
  specs+=("$name==$version")
done
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d "$DEST" "${specs[@]}"
ls -1 "$DEST"
du -sh "$DEST"
