#!/usr/bin/env bash
# Deviceless compiles for the GPUs and TPUs of akv_jax/aot/targets.py (what CI runs after the
# main suite): build .venv-aot once (libtpu, the CUDA PJRT plugin, pip's ptxas: the `aot`
# extra), then the `aot` tests (the CI set of bench/aot.py) in their own process.
# Exits non-zero when any target fails to compile.
#
# The toolchains live in their own venv so the main suite's .venv keeps a CPU-only jax (a
# TPU or CUDA plugin there would be probed at every backend start). jax, jaxlib and the
# plugins are pinned to the main .venv's exact jax version: the plugins must match jaxlib.
# Usage: bash scripts/aot.sh [--full | --build-only]
#   --full: the whole matrix (too long for CI); --build-only: build .venv-aot and stop
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv=.venv-aot
if [ -x .venv/bin/python ]; then
  jv="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("jax"))')"
else
  jv="${AKV_AOT_JAX:-0.12.0.1}"
fi
if [ ! -x "$venv/bin/python" ] || [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("jax"))' 2>/dev/null)" != "$jv" ]; then
  start=$SECONDS
  py="/usr/bin/env python3.12"
  [ -x .venv/bin/python ] && py="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
  $py -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".[aot]" "jax[tpu]==$jv" "jaxlib==$jv" \
    "jax-cuda12-plugin==$jv" "jax-cuda12-pjrt==$jv"
  echo "aot: built $venv (jax $jv) in $((SECONDS - start)) s" >&2
fi
[ "${1:-}" = "--build-only" ] && exit 0
py="$venv/bin/python"
# Read when jax's backends start: no local driver/cuDNN check; ptxas' -v report logged.
export JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=subprocess_compilation=2 \
  ALLOW_MULTIPLE_LIBTPU_LOAD=1
if [ "${1:-}" = "--full" ]; then
  "$py" bench/aot.py 2> >(grep -v -E "^\s*$|TPU_|libtpu|InitGoogle|Source Location|DeprecationWarning|warnings.warn" >&2)
else
  # The CI set (bench/aot.py --ci's compiles) as tests, so each compile runs once: every
  # target, the paper's setup, the oversized block that must fail.
  "$py" -m pytest -q -ra -m aot -p no:cacheprovider --durations=5 tests/test_aot.py
fi
