#!/usr/bin/env bash
# One entry point for everything: creates (or reuses) ./.venv with the pinned versions, then runs
#   ./run.sh demo [ARGS]    the main job (build every model, evaluate it at several resolutions)
#   ./run.sh test [ARGS]    the whole test suite (pytest ARGS)
#   ./run.sh bench NAME     a script from benchmarks/ (e.g. ./run.sh bench vit_throughput)
#   ./run.sh python ARGS    python inside the environment
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

VENV=.venv
PY_BOOT=${PYTHON:-}
if [ -z "$PY_BOOT" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY_BOOT=$candidate; break; fi
  done
fi
[ -n "$PY_BOOT" ] || { echo "run.sh: no python3.11 or python3 on PATH" >&2; exit 1; }

ensure_env() {
  local stamp want
  want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
  stamp="$VENV/.vision_priors_stamp"
  if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  echo "run.sh: setting up $VENV (first run takes a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$PY_BOOT" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -c constraints.txt -e ".[test]"
  fetch_timm_tests
  echo "$want" > "$stamp"
}

# timm's own model test suite (tests/test_models.py) ships only in timm's source distribution;
# tests/test_timm_suite.py runs it on our models. Fetched once, for the pinned timm version.
fetch_timm_tests() {
  local ver dest
  ver=$("$VENV/bin/python" -c "import timm; print(timm.__version__)")
  dest=".cache/timm-$ver"
  [ -f "$dest/tests/test_models.py" ] && return
  mkdir -p .cache/sdist
  "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: "timm==$ver" -d .cache/sdist
  tar -xzf ".cache/sdist/timm-$ver.tar.gz" -C .cache "timm-$ver/tests"
}

cmd=${1:-demo}
shift || true
ensure_env
case "$cmd" in
  demo)   exec "$VENV/bin/python" -m vision_priors.recipes.resolution_extrapolation compare "$@" ;;
  test)   exec "$VENV/bin/python" -m pytest "$@" ;;
  bench)  name=$1; shift; exec "$VENV/bin/python" "benchmarks/$name.py" "$@" ;;
  python) exec "$VENV/bin/python" "$@" ;;
  *) echo "run.sh: unknown command '$cmd' (expected demo, test, bench or python)" >&2; exit 2 ;;
esac
