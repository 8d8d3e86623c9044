#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m pytest -q "$@"
