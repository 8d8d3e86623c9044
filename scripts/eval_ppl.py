"""Perplexity of one checkpoint under each `quantization`, on a text that ships with the repo, and the float32 twin
against transformers loading the same file.

The text (scripts/data/eval_text.txt, ~1,900 tokens of plain English) is tokenized once and cut into windows of
--window tokens; every window is scored on its own (its first token is context only). raylm scores all windows in one
`generate` call through `prompt_logprobs`; transformers runs each window's forward. Printed per method: perplexity
and its change against `none` (the dequantized float32 twin; the target is within 2%), and for `none` the largest
difference from transformers of any log-probability raylm reports (each position's top 5 and the actual token;
log-probabilities are the logits less one constant per position; the target is 1e-4).

    python scripts/eval_ppl.py                        # the default SmolLM2 GGUF: none, gguf, int8, int4
    python scripts/eval_ppl.py --model PATH --methods none int8 int4
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from raylm.cluster.models.default_gguf import default_gguf_path  # noqa: E402
from raylm.configs.gguf_metadata import get_tokenizer, is_gguf  # noqa: E402

TEXT = Path(__file__).with_name("data") / "eval_text.txt"
TOP_K = 5
Scores = list[list[dict[int, float]]]  # per window, per scored position: {token: logprob} (top-k and actual)


def windows(model: str, size: int) -> list[list[int]]:
    ids = get_tokenizer(model).encode(TEXT.read_text())
    return [ids[i:i + size] for i in range(0, len(ids) - 1, size) if len(ids[i:i + size]) > 1]


def raylm_scores(model: str, method: str, chunks: list[list[int]], window: int) -> Scores:
    llm = LLM(model=model, quantization=method, max_model_len=window + 1, enable_prefix_caching=False,
              disable_log_stats=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                               SamplingParams(max_tokens=1, prompt_logprobs=TOP_K), use_tqdm=False)
    finally:
        llm.shutdown()
    return [[lp for lp in out.prompt_logprobs[1:]] for out in outputs]


@torch.inference_mode()
def transformers_scores(model: str, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Per window, log_softmax of the logits at every position but the last: [len - 1, vocab]."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    kwargs = {"gguf_file": path.name} if is_gguf(path) else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if is_gguf(path) else path, dtype=torch.float32,
                                              **kwargs).eval()
    return [torch.log_softmax(hf(torch.tensor([c])).logits[0, :-1].float(), dim=-1) for c in chunks]


def largest_gap(scores: Scores, reference: list[torch.Tensor]) -> float:
    """The largest |raylm - transformers| over every log-probability raylm reported."""
    return max(abs(logprob - ref[i, token].item()) for window, ref in zip(scores, reference)
               for i, position in enumerate(window) for token, logprob in position.items())


def perplexity(chunks: list[list[int]], scores: Scores) -> float:
    nll = [-position[token] for chunk, window in zip(chunks, scores) for token, position in zip(chunk[1:], window)]
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder or .gguf file (default: the fetched SmolLM2 GGUF)")
    parser.add_argument("--methods", nargs="+", help="quantization methods (default: none gguf int8 int4 for a GGUF "
                                                     "file, none int8 int4 otherwise)")
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers comparison")
    args = parser.parse_args()
    model = args.model or str(default_gguf_path() or parser.error("no --model and no fetched default GGUF "
                                                                  "(scripts/fetch_default_model.py)"))
    methods = args.methods or (["none", "gguf", "int8", "int4"] if is_gguf(model) else ["none", "int8", "int4"])
    chunks = windows(model, args.window)
    print(f"{model}: {sum(len(c) for c in chunks)} tokens of {TEXT.name} in {len(chunks)} windows of up to "
          f"{args.window}", file=sys.stderr)
    results = {method: raylm_scores(model, method, chunks, args.window) for method in methods}
    ppl = {method: perplexity(chunks, scores) for method, scores in results.items()}
    reference = None if args.skip_hf else transformers_scores(model, chunks)
    print("| quantization | perplexity | vs none | max abs logprob difference from transformers |\n|---|---|---|---|")
    for method, scores in results.items():
        change = f"{(ppl[method] / ppl['none'] - 1) * 100:+.2f}%" if "none" in ppl else ""
        gap = "" if reference is None else f"{largest_gap(scores, reference):.2e}"
        print(f"| {method} | {ppl[method]:.3f} | {change} | {gap} |")
    if reference is not None:
        hf_ppl = math.exp(-sum(ref[i, t].item() for chunk, ref in zip(chunks, reference)
                               for i, t in enumerate(chunk[1:])) / sum(len(c) - 1 for c in chunks))
        print(f"transformers (float32, same file): perplexity {hf_ppl:.3f}")


if __name__ == "__main__":
    main()
