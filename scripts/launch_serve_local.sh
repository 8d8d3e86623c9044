#!/usr/bin/env bash
# Serve the OpenAI API on this machine (the tiny default model unless --model is given):
#   scripts/launch_serve_local.sh            a Ray Serve app on a local Ray (or $RAY_ADDRESS's cluster)
#   scripts/launch_serve_local.sh --no-ray   one engine under uvicorn in this process (what `vllm serve` does)
# Other arguments go to `raylm serve`, e.g. --model /path/to/checkpoint --port 8001 --api-key sk-... Ctrl-C stops it.
# Then, from another shell:
#   curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"prompt": "Once upon a time", "max_tokens": 16}'
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m cluster.cli serve --config configs/tiny.yaml "$@"
