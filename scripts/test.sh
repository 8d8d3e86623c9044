#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (GPU tests skip without CUDA).
# Without arguments (as .ci/run calls it) mypy checks raylm/ first ([tool.mypy] in pyproject.toml) and a type
# error fails the run; with arguments they go to pytest alone.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0
if [ "$#" -eq 0 ]; then
  .venv/bin/mypy
  set -- --durations=30  # the whole suite lists its slowest tests: the budget is ~20 minutes on 2 cores
fi
exec .venv/bin/python -m pytest -q "$@"
