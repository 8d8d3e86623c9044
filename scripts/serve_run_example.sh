#!/usr/bin/env bash
# Ray Serve's own launcher on our Serve config file: `serve run` builds the app with raylm.cluster.serve.app:build_app
# (on a local Ray, or $RAY_ADDRESS's cluster) and blocks until Ctrl-C. Related forms:
#   serve deploy raylm/configs/serve-tiny.yaml                                  detached, on a running cluster
#   ray job submit --working-dir . -- serve run raylm/configs/serve-tiny.yaml   as a Ray job
# The API is then at http://127.0.0.1:8000/v1 (http_options in the YAML).
# Needs Ray's `serve` command on PATH: an activated environment where raylm is installed, or the .venv that
# scripts/bootstrap.sh makes.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v serve >/dev/null 2>&1 && [ -x .venv/bin/serve ]; then
  export PATH="$PWD/.venv/bin:$PATH"
fi
if ! command -v serve >/dev/null 2>&1; then
  echo "serve_run_example.sh: no \`serve\` on PATH; install raylm (\`pip install -e .\`) or run scripts/bootstrap.sh" >&2
  exit 1
fi
export RAY_USAGE_STATS_ENABLED=0
exec serve run raylm/configs/serve-tiny.yaml
