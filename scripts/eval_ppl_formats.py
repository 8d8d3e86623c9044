"""Perplexity of SmolLM2-135M quantized as shipped (compressed-tensors, GPTQ, AWQ), each folder written on CPU by its
format's own tool, in raylm and in transformers loading the same folder, against the float32 checkpoint.

The quantized folders go under models/ (git-ignored) and are reused when present (--force writes them again).
compressed-tensors: its own quantize-and-pack path (tests/quant_format_checkpoints.py: min / max round to nearest, what
llmcompressor's QuantizationModifier does without calibration; llmcompressor itself pins an older transformers).
GPTQ and AWQ: GPTQModel, calibrated on a few sequences of the repo's own docs (not the evaluated text). The text and
windows are scripts/eval_ppl.py's; group size 64 throughout (SmolLM2's hidden size 576 is 9 groups of 64, not whole
groups of 128).

    python scripts/eval_ppl_formats.py                      # every format
    python scripts/eval_ppl_formats.py --formats ct-w4a16 gptq-w4 --skip-hf
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.eval_ppl import largest_gap, perplexity, raylm_scores, windows  # noqa: E402

FLOAT32 = ROOT / "models" / "smollm2-135m-f32"
GROUP = 64
CALIBRATION_SEQUENCES, CALIBRATION_LEN = 32, 256


def calibration(model: Path, count: int = CALIBRATION_SEQUENCES) -> list[dict[str, torch.Tensor]]:
    """`count` windows of the repo's docs: text the evaluation never scores."""
    from transformers import AutoTokenizer

    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = AutoTokenizer.from_pretrained(model).encode(text)
    step = max(CALIBRATION_LEN, len(ids) // count)
    return [{"input_ids": torch.tensor([ids[i:i + CALIBRATION_LEN]]),
             "attention_mask": torch.ones(1, CALIBRATION_LEN, dtype=torch.long)}
            for i in range(0, len(ids) - CALIBRATION_LEN, step)][:count]


def compressed_tensors(scheme: str) -> Callable[[Path, Path], None]:
    def write(src: Path, out: Path) -> None:
        from tests.quant_format_checkpoints import write_compressed_tensors

        write_compressed_tensors(src, scheme, out, group_size=GROUP if "group" in scheme else None)
    return write


def gptqmodel(method: str, **settings: object) -> Callable[[Path, Path], None]:
    def write(src: Path, out: Path) -> None:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
        from gptqmodel import BACKEND, AWQConfig, GPTQModel, QuantizeConfig

        config = (AWQConfig if method == "awq" else QuantizeConfig)(bits=4, group_size=GROUP, **settings)
        model = GPTQModel.load(str(src), config, device="cpu")
        cwd = os.getcwd()
        os.chdir(out.parent)  # GPTQModel writes timing logs under ./logs: keep them beside the models
        try:
            # AWQ's default kernel choice (AWQ_GEMM) asks for CUDA; its torch kernel packs the same GEMM layout
            # AWQ searches 20 scale ratios per layer group: 4 sequences keep it to minutes on 2 shared cores
            model.quantize(calibration(src, 4 if method == "awq" else CALIBRATION_SEQUENCES), batch_size=1,
                           backend=BACKEND.TORCH)
        finally:
            os.chdir(cwd)
        model.save(str(out))
    return write


def awq_round_to_nearest(src: Path, out: Path) -> None:
    """AWQ's GEMM layout packed by GPTQModel's AWQ packer from min / max scales, without AWQ's scale search (which
    takes ~2 minutes a layer on 2 shared cores here): the layout raylm and transformers read, not AWQ's quality."""
    from tests.quant_format_checkpoints import write_awq

    write_awq(src, out, group_size=GROUP)


# name -> (what it is, weight bits, the tool that writes it, raylm's `quantization`)
FORMATS: dict[str, tuple[str, int, Callable[[Path, Path], None], str]] = {
    "ct-w4a16": ("compressed-tensors int4 group 64 symmetric", 4, compressed_tensors("w4a16-group-sym"),
                 "compressed-tensors"),
    "ct-w4a16-asym": ("compressed-tensors int4 group 64 zero points", 4, compressed_tensors("w4a16-group-asym"),
                      "compressed-tensors"),
    "ct-w8a16": ("compressed-tensors int8 per channel", 8, compressed_tensors("w8a16-channel-sym"),
                 "compressed-tensors"),
    "ct-w8a8": ("compressed-tensors W8A8 int8 (dynamic per-token activations)", 8, compressed_tensors("w8a8-int"),
                "compressed-tensors"),
    "ct-fp8": ("compressed-tensors FP8 per channel (dynamic per-token activations)", 8,
               compressed_tensors("fp8-channel"), "compressed-tensors"),
    "gptq-w4": ("GPTQ 4-bit group 64 symmetric", 4, gptqmodel("gptq", desc_act=False, sym=True), "gptq"),
    "gptq-w4-desc_act": ("GPTQ 4-bit group 64 zero points, desc_act", 4, gptqmodel("gptq", desc_act=True, sym=False),
                         "gptq"),
    "awq-w4": ("AWQ 4-bit group 64 GEMM", 4, gptqmodel("awq", sym=False), "awq"),
    "awq-w4-rtn": ("AWQ GEMM layout, round-to-nearest group 64 zero points", 4, awq_round_to_nearest, "awq"),
}


def quantized_folder(name: str, force: bool) -> Path:
    out = ROOT / "models" / f"smollm2-135m-{name}"
    if out.exists() and not force:
        return out
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    FORMATS[name][2](FLOAT32, out)
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if not (out / extra).exists():
            shutil.copy(FLOAT32 / extra, out / extra)
    print(f"{name}: quantized in {time.perf_counter() - start:.0f} s -> {out}", file=sys.stderr)
    return out


@torch.inference_mode()
def transformers_logprobs(name: str, path: Path, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Per window, log_softmax over the vocabulary at every position but the last, as transformers runs the folder:
    compressed-tensors through its integration (asymmetric int4 dequantized: its compressed path cannot load packed
    zero points), GPTQ / AWQ through optimum + GPTQModel's CPU kernels (which compute in float16)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    settings: dict[str, object] = {"device_map": "cpu"}
    if name.startswith("ct-"):
        settings = {"quantization_config": CompressedTensorsConfig(run_compressed="asym" not in name)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **settings).eval()
    return [torch.log_softmax(model(torch.tensor([c])).logits[0, :-1].float(), dim=-1) for c in chunks]


def reference_perplexity(chunks: list[list[int]], reference: list[torch.Tensor]) -> float:
    nll = [-ref[i, t].item() for chunk, ref in zip(chunks, reference) for i, t in enumerate(chunk[1:])]
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument("--force", action="store_true", help="quantize again even where the folder exists")
    parser.add_argument("--quantize-only", action="store_true", help="write the folders, score nothing")
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers")
    args = parser.parse_args()
    folders = {name: quantized_folder(name, args.force) for name in args.formats}
    if args.quantize_only:
        return
    chunks = windows(str(FLOAT32), args.window)
    base = perplexity(chunks, raylm_scores(str(FLOAT32), "none", chunks, args.window))
    print(f"{sum(len(c) - 1 for c in chunks)} scored tokens in {len(chunks)} windows; load average "
          f"{os.getloadavg()[0]:.1f}", file=sys.stderr)
    print("| format | bits | raylm ppl | vs float32 | transformers ppl | vs float32 | max abs logprob diff |")
    print("|---|---|---|---|---|---|---|")
    hf_base = None if args.skip_hf else reference_perplexity(chunks, transformers_logprobs("float", FLOAT32, chunks))
    print(f"| float32 | 32 | {base:.3f} | | {'' if hf_base is None else f'{hf_base:.3f}'} | | |")
    for name, path in folders.items():
        what, bits, _, method = FORMATS[name]
        scores = raylm_scores(str(path), method, chunks, args.window)
        ppl = perplexity(chunks, scores)
        hf = "| | | |"
        if hf_base is not None:
            reference = transformers_logprobs(name, path, chunks)
            hf_ppl = reference_perplexity(chunks, reference)
            hf = (f"| {hf_ppl:.3f} | {(hf_ppl / hf_base - 1) * 100:+.2f}% | "
                  f"{largest_gap(scores, reference):.1e} |")
        print(f"| {name} ({what}) | {bits} | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f}% {hf}", flush=True)


if __name__ == "__main__":
    main()
