#!/usr/bin/env bash
# Fetch wheels to carry to the GPU machine for the device check, into .device_wheels/
# (git-ignored): CPython 3.12, manylinux x86_64, no dependencies resolved (name each one).
#
#   bash scripts/device_wheels.sh                      # the check's own set: none
#   bash scripts/device_wheels.sh fastapi starlette    # distributions, at .venv's versions
#
# The check needs no wheel: its parts import only jax and numpy, which the device image has
# (the engine path imports no HTTP stack: `bash scripts/device_check.sh --cpu` passes with
# AKV_CHECK_PYTHON pointing at a venv holding jax alone). Its "imports akv_jax, converters"
# check lists which modules need which package the image lacks (fastapi, pydantic, ...).
# To import some of those there anyway, name their distributions here (each pinned to the
# version .venv has, the one CI tests); then pass carry [".device_wheels"] to the run
# tool, and scripts/device_check.sh unpacks them into .device_wheels/site, searched after
# the image's own packages. Prints each wheel and its size; refuses more than 48 MiB (the
# run tool carries 64 MiB in all).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dest=.device_wheels
limit=$((48 * 1024 * 1024))
py=.venv/bin/python
[ -x "$py" ] || py=python3

specs=()
for dist in "$@"; do
  version="$("$py" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' \
    "$dist" 2>/dev/null || true)"
  specs+=("$dist${version:+==$version}")
done
if [ "${#specs[@]}" -eq 0 ]; then
  echo "device_wheels: nothing to fetch: the device check needs only the image's jax and numpy"
  exit 0
fi

mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest" \
  --implementation cp --python-version 3.12 --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 "${specs[@]}"
rm -rf "$dest/site"  # unpacked again on the device from the new set

total=0
for w in "$dest"/*.whl; do
  size=$(stat -c %s "$w")
  total=$((total + size))
  awk -v s="$size" -v n="$(basename "$w")" 'BEGIN { printf "%8.2f MiB  %s\n", s / 1048576, n }'
done
awk -v s="$total" -v d="$dest" 'BEGIN { printf "%8.2f MiB  in all (%s)\n", s / 1048576, d }'
if [ "$total" -gt "$limit" ]; then
  echo "device_wheels: over 48 MiB: carry fewer" >&2
  exit 1
fi
