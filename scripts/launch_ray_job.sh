#!/usr/bin/env bash
# Serve the OpenAI API as a Ray job: `ray job submit --working-dir . -- raylm serve ...`. Starts a local head
# node first when no cluster is running, then waits until the API answers. The app lives as long as the job:
#   ray job logs --follow <id>      watch it
#   ray job stop <id>               stop it (raylm gets SIGTERM and shuts Serve down)
#   ray stop                        stop the head node this script started
# Extra arguments go to `raylm serve`, e.g. scripts/launch_ray_job.sh --model /path/to/checkpoint
# Needs `ray` (and raylm's dependencies) on PATH: an activated environment where raylm is installed, or the .venv that
# scripts/bootstrap.sh makes.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v ray >/dev/null 2>&1 && [ -x .venv/bin/ray ]; then
  export PATH="$PWD/.venv/bin:$PATH"
fi
if ! command -v ray >/dev/null 2>&1; then
  echo "launch_ray_job.sh: no \`ray\` on PATH; install raylm (\`pip install -e .\`) or run scripts/bootstrap.sh" >&2
  exit 1
fi
export RAY_USAGE_STATS_ENABLED=0
# The entrypoint runs on the head node, from the shipped working dir: the `raylm` command where this environment
# has it, else the module itself (any Python with raylm's dependencies).
if command -v raylm >/dev/null 2>&1; then entrypoint=(raylm); else entrypoint=(python -m raylm.cluster.entrypoints.cli); fi
# Ray >= 2.5x starts clusters with token auth (~/.ray/auth_token); the job CLI must send the token too.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
port=${PORT:-8000}
dashboard=${RAY_DASHBOARD:-http://127.0.0.1:8265}

if ! ray job list --address "$dashboard" >/dev/null 2>&1; then
  # RAY_START_ARGS: more `ray start` flags, e.g. "--num-gpus 8" or "--temp-dir /tmp/other".
  ray start --head --num-cpus "${NUM_CPUS:-4}" --dashboard-host 127.0.0.1 ${RAY_START_ARGS:-}
fi

job_id=raylm-$(date +%s)
# Serve's graceful shutdown takes several seconds: give it more than Ray's default 3 s before SIGKILL.
ray job submit --address "$dashboard" --submission-id "$job_id" --no-wait --working-dir . \
  --runtime-env-json '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}' \
  -- "${entrypoint[@]}" serve --config raylm/configs/tiny.yaml --port "$port" "$@"

until curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
  case "$(ray job status --address "$dashboard" "$job_id" 2>/dev/null)" in
    *FAILED*|*STOPPED*) ray job logs --address "$dashboard" "$job_id"; exit 1 ;;
  esac
  sleep 2
done
echo "raylm: job $job_id serves http://127.0.0.1:$port/v1"
echo "  logs: ray job logs --address $dashboard --follow $job_id"
echo "  stop: ray job stop --address $dashboard $job_id   (and \`ray stop\` for a head node started here)"
