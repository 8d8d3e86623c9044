#!/usr/bin/env bash
# Serve the OpenAI API on this machine (the tiny default model unless --model is given):
#   scripts/launch_serve_local.sh            a Ray Serve app on a local Ray (or $RAY_ADDRESS's cluster)
#   scripts/launch_serve_local.sh --no-ray   one engine under uvicorn in this process (what `vllm serve` does)
# Other arguments go to `raylm serve`, e.g. --model /path/to/checkpoint --port 8001 --api-key sk-... Ctrl-C stops it.
# Then, from another shell:
#   curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"prompt": "Once upon a time", "max_tokens": 16}'
# Needs `raylm` on PATH: an activated environment where raylm is installed, or the .venv that scripts/bootstrap.sh
# makes.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v raylm >/dev/null 2>&1 && [ -x .venv/bin/raylm ]; then
  export PATH="$PWD/.venv/bin:$PATH"
fi
if ! command -v raylm >/dev/null 2>&1; then
  echo "launch_serve_local.sh: no \`raylm\` on PATH; install raylm (\`pip install -e .\`) or run scripts/bootstrap.sh" >&2
  exit 1
fi
export RAY_USAGE_STATS_ENABLED=0
exec raylm serve --config raylm/configs/tiny.yaml "$@"
