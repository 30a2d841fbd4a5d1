#!/usr/bin/env bash
# Install everything and run the test suite (what CI runs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh dev
py=.venv/bin/python
# Main suite (one process), then the 8-device tests in their own process: XLA_FLAGS must be
# set before jax is imported.
"$py" -m pytest -q -ra "$@"
XLA_FLAGS=--xla_force_host_platform_device_count=8 "$py" -m pytest -q -ra \
  -m "multidevice and not slow" \
  tests/
# Deviceless compiles for every GPU and TPU target (own venv, own processes): fails CI when a
# target rejects a kernel or the serving step.
bash scripts/aot.sh
