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
# The main suite and the 8-device tests (their own processes: XLA_FLAGS must be set before
# jax is imported) side by side, two pytest-xdist workers each, a test file per worker at a
# time: a module keeps its fixtures in one process. One after the other they left the two
# cores a third idle (server tests wait on their subprocesses; a worker whose files are done
# waits for the other's last one).
workers="${AKV_TEST_WORKERS:-2}"
XLA_FLAGS=--xla_force_host_platform_device_count=8 "$py" -m pytest -q -ra \
  -n "$workers" --dist loadfile --durations=15 -m "multidevice and not slow" \
  tests/ > .ci-logs/multidevice.log 2>&1 &
multidevice=$!
# --durations: the slowest tests in the log, to keep the suite inside CI's 30 minutes.
main_rc=0
"$py" -m pytest -q -ra -n "$workers" --dist loadfile --durations=25 "$@" || main_rc=$?
multidevice_rc=0
wait "$multidevice" || multidevice_rc=$?
echo "== multidevice tests (XLA_FLAGS=--xla_force_host_platform_device_count=8)"
cat .ci-logs/multidevice.log
if [ "$main_rc" -ne 0 ] || [ "$multidevice_rc" -ne 0 ]; then
  echo "tests failed: main suite exit $main_rc, multidevice exit $multidevice_rc" >&2
  exit 1
fi
# Deviceless compiles for every GPU and TPU target (own venv, own processes): fails CI when a
# target rejects a kernel or the serving step.
wait "$aot_build" || { cat .ci-logs/aot-build.log >&2; exit 1; }
bash scripts/aot.sh
