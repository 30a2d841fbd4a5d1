#!/usr/bin/env bash
# Install everything and run the test suite (what CI runs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh dev
py=.venv/bin/python
# The deviceless-compile venv (.venv-aot: mostly downloads) builds while the suite runs.
mkdir -p .ci-logs
bash scripts/aot.sh --build-only > .ci-logs/aot-build.log 2>&1 &
aot_build=$!
# Main suite, then the 8-device tests in their own processes (XLA_FLAGS must be set before
# jax is imported). Two pytest-xdist workers each, a test file per worker at a time: most of
# the suite is single-threaded (XLA compiles, Pallas interpret mode), and a module keeps its
# fixtures in one process.
workers="${AKV_TEST_WORKERS:-2}"
# One persistent XLA compilation cache for the run (emptied first): most of the suite's time
# is XLA compiles of the same tiny models' steps, in every test module, worker and server
# process. A server's --compile-cache-dir still wins for its own process.
export JAX_COMPILATION_CACHE_DIR="$root/.ci-logs/jax-cache"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
rm -rf "$JAX_COMPILATION_CACHE_DIR"
# --durations: the slowest tests in the log, to keep the suite inside CI's 30 minutes.
# Every test's time in .ci-logs/main.xml (JUnit): what to trim when CI runs long.
"$py" -m pytest -q -ra -n "$workers" --dist loadfile --durations=25 \
  --junitxml=.ci-logs/main.xml "$@"
# The GPU device check's plumbing, on the CPU (small shapes, Pallas interpreted): what a lent
# GPU will run must work before device time is spent on it (docs/device_check.md).
OUT=.ci-logs/device_check bash scripts/device_check.sh --cpu
XLA_FLAGS=--xla_force_host_platform_device_count=8 "$py" -m pytest -q -ra \
  -n "$workers" --dist loadfile --durations=15 --junitxml=.ci-logs/multidevice.xml \
  -m "multidevice and not slow" \
  tests/
# Deviceless compiles for every GPU and TPU target (own venv, own processes): fails CI when a
# target rejects a kernel or the serving step.
wait "$aot_build" || { cat .ci-logs/aot-build.log >&2; exit 1; }
env -u JAX_COMPILATION_CACHE_DIR bash scripts/aot.sh
