#!/usr/bin/env bash
# Install and start the server on the embedded default model (127.0.0.1:30000).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/venv.sh"
exec "$root/.venv/bin/python" -m akv_jax.serving.main "$@"
