#!/usr/bin/env bash
# One prepared check of akv_jax on a lent GPU (H200 or H100), or of its plumbing here (--cpu).
#
#   bash scripts/device_check.sh            # on the GPU machine, from the repository root
#   bash scripts/device_check.sh --cpu      # here: small shapes, Pallas interpreted (CI runs it)
#   bash scripts/device_check.sh --parts "bandwidth step"   # a rerun of some parts only
#
# The run tool's command (docs/device_check.md): `bash scripts/device_check.sh`, timeout_s
# 600, carry [".device_wheels"] only when scripts/device_wheels.sh fetched something.
#
# Parts, in this order, each its own process (bench/device_check.py --part NAME) under its
# own timeout, writing $OUT/<part>.json after every check; then one summary line
# ("device_check: K/N checks pass on ...") and $OUT/summary.json. Budgets (seconds) on a
# device / with --cpu; expected on an H200 about 5 minutes in all:
#   kernels    150 / 120  segment attention and repos vs the jnp references, f32 and bf16
#   engine     150 / 200  the engine on tiny, tiny-gpt-oss, tiny-qwen3-moe vs the dense reference
#   bits        90 /  90  --deterministic: a request's log-prob bits amid a batch == alone
#   bandwidth   60 /  60  decode attention's achieved HBM bandwidth, three model shapes
#   peer        45 /  30  torch's SDPA on the same shapes (its own process, no jax; if torch)
#   step       140 /  90  a GPT-OSS-20B-shaped decode step's tokens/s vs its roofline
# No part starts past 570 s from the start (AKV_CHECK_DEADLINE_S), so one run fits the run
# tool's 600 s, and a part cut short by its timeout keeps its finished checks.
#
# Python: the image's (the first of python3, python, python3.12 that imports jax; its jax as
# installed there, the versions printed first), or .venv's with --cpu; AKV_CHECK_PYTHON
# overrides. It needs only jax and numpy (the engine
# path imports no HTTP stack). Wheels in .device_wheels/ (scripts/device_wheels.sh) are
# unpacked into .device_wheels/site and searched after the image's own packages.
# $OUT: where results go (the run tool sets it); default .device_check/ (git-ignored).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

start=$SECONDS
cpu=0
parts="kernels engine bits bandwidth peer step"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 ;;
    --parts) parts="$2"; shift ;;
    *) echo "usage: $0 [--cpu] [--parts \"kernels engine bits bandwidth peer step\"]" >&2; exit 2 ;;
  esac
  shift
done

out="${OUT:-$root/.device_check}"
mkdir -p "$out"
rm -f "$out"/*.json

if [ -n "${AKV_CHECK_PYTHON:-}" ]; then
  py="$AKV_CHECK_PYTHON"
elif [ "$cpu" = 1 ] && [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else  # the image's: the first Python that has jax
  py=python3
  for c in python3 python python3.12; do
    if "$c" -c 'import jax' > /dev/null 2>&1; then py="$c"; break; fi
  done
fi

# Carried wheels: unpacked once (pip when the image has it, else as the zip files they are).
site="$root/.device_wheels/site"
if compgen -G ".device_wheels/*.whl" > /dev/null && [ ! -e "$site/.done" ]; then
  mkdir -p "$site"
  if "$py" -m pip --version > /dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --target "$site" .device_wheels/*.whl
  else
    for w in .device_wheels/*.whl; do "$py" -m zipfile -e "$w" "$site"; done
  fi
  touch "$site/.done"
fi
[ -d "$site" ] && export AKV_DEVICE_SITE="$site"

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# GPU memory taken as needed, up to 90% (the step part holds ~45 GB of weights and pool).
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
if [ "$cpu" = 1 ]; then
  export JAX_PLATFORMS=cpu
  flag=--cpu
  budgets="kernels=120 engine=200 bits=90 bandwidth=60 peer=30 step=90"
else
  # Compiled programs kept between runs on the same (warm) machine: a rerun compiles less.
  export JAX_COMPILATION_CACHE_DIR="$root/.device_check_cache"
  flag=
  budgets="kernels=150 engine=150 bits=90 bandwidth=60 peer=45 step=140"
fi
deadline="${AKV_CHECK_DEADLINE_S:-570}"

"$py" - <<'EOF' || { echo "device_check: $py has no jax" >&2; exit 1; }
import importlib.metadata as m
import platform
print(f"device_check: python {platform.python_version()}, jax {m.version('jax')}, "
      f"jaxlib {m.version('jaxlib')}")
EOF

rcs=()
for part in $parts; do
  budget=$(tr ' ' '\n' <<< "$budgets" | sed -n "s/^$part=//p")
  [ -n "$budget" ] || { echo "unknown part $part" >&2; exit 2; }
  left=$((deadline - (SECONDS - start) - 10))  # 10 s kept for the summary
  if [ "$left" -lt 20 ]; then
    rcs+=("$part=-1")
    continue
  fi
  [ "$budget" -gt "$left" ] && budget=$left
  timeout -k 10 "$budget" "$py" bench/device_check.py --part "$part" $flag --out "$out" \
    --budget-s "$budget"
  rcs+=("$part=$?")
done

"$py" bench/device_check.py --summary --out "$out" --seconds $((SECONDS - start)) \
  --rc "${rcs[@]}"
