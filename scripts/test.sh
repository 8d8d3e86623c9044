#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (GPU tests skip without CUDA).
# Without arguments (as .ci/run calls it) mypy checks raylm/ too ([tool.mypy] in pyproject.toml) and a type error
# fails the run; with arguments they go to pytest alone.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0
if [ "$#" -ne 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
# mypy runs beside the suite at the lowest priority: it takes the time the cores idle while tests wait on Ray and
# servers (a cold mypy is ~50 s of CPU), instead of adding its own minute before them.
mypy_log=$(mktemp)
nice -n 19 .venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
status=0
.venv/bin/python -m pytest -q --durations=30 || status=$?  # the suite lists its slowest tests: ~20 minutes on 2 cores
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
echo "mypy:" && cat "$mypy_log" && rm -f "$mypy_log"
[ "$mypy_status" -eq 0 ] || exit "$mypy_status"
exit "$status"
