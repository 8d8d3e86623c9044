"""The correctness oracle (DESIGN.md section 7): transformers' greedy generate on the same
checkpoint, and vLLM's check_logprobs_close rule for comparing against it."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

TOP_K = 5
# Where raylm and transformers, both in bfloat16, pick different greedy tokens, transformers' own logits for the two
# must lie closer than this: a near-tie that rounding (another summation order, a fused op) may tip either way.
NEAR_TIE = 0.02


@torch.inference_mode()
def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: the greedy tokens and, per position, the top-5 {token: logprob}."""
    return model_greedy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompts, max_tokens)


@torch.inference_mode()
def model_greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int
                 ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """hf_greedy on a model already loaded (a quantized one, a PEFT one, a GGUF one)."""
    results = []
    for prompt in prompts:
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        tokens = out.sequences[0, len(prompt):].tolist()
        tops = []
        for logits in out.logits:
            values, ids = torch.log_softmax(logits[0].float(), dim=-1).topk(TOP_K)
            tops.append(dict(zip(ids.tolist(), values.tolist())))
        results.append((tokens, tops))
    return results


def check_logprobs_close(reference: list[tuple[list[int], list[dict[int, float]]]],
                         ours: list[tuple[list[int], list[dict[int, float]]]], name: str) -> int:
    """Token-exact until a divergence; where they diverge each side's token must be in the other's
    top-5, and the comparison of that sequence stops. Returns how many sequences diverged."""
    assert len(reference) == len(ours)
    diverged = 0
    for i, ((ref_tokens, ref_top), (our_tokens, our_top)) in enumerate(zip(reference, ours)):
        assert len(ref_tokens) == len(our_tokens), f"{name} prompt {i}: {len(ref_tokens)} != {len(our_tokens)} tokens"
        for pos, (ref_token, our_token) in enumerate(zip(ref_tokens, our_tokens)):
            if ref_token == our_token:
                continue
            where = f"{name} prompt {i} position {pos}"
            assert ref_token in our_top[pos], (
                f"{where}: transformers chose {ref_token}, not in raylm's top-5 {our_top[pos]}")
            assert our_token in ref_top[pos], (
                f"{where}: raylm chose {our_token}, not in transformers' top-5 {ref_top[pos]}")
            diverged += 1
            break
    return diverged


def assert_same_output(ours: list[tuple[list[int], list[dict[int, float]]]],
                       reference: list[tuple[list[int], list[dict[int, float]]]]) -> None:
    """Two raylm runs agree: the same greedy tokens, and the same top-k logprobs up to float summation order
    (another batch composition or parallel layout sums in another order)."""
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in reference]
    for (_, our_logprobs), (_, ref_logprobs) in zip(ours, reference):
        for ours_at, ref_at in zip(our_logprobs, ref_logprobs, strict=True):
            assert ours_at.keys() == ref_at.keys()
            assert all(abs(ours_at[t] - ref_at[t]) < 1e-4 for t in ours_at)


@torch.inference_mode()
def greedy_with_logits(model: torch.nn.Module, prompts: list[list[int]],
                       max_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: a transformers model's greedy tokens and its logits (float32) at each position."""
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             eos_token_id=None)
        results.append((out.sequences[0, len(prompt):].tolist(), torch.stack([lg[0].float() for lg in out.logits])))
    return results


def assert_equal_but_near_ties(reference: list[tuple[list[int], torch.Tensor]], ours: list[list[int]],
                               relative: float = 0.0) -> int:
    """The 16-bit parity rule: equal greedy tokens, except that a sequence may leave the reference's at a position
    where the reference's own logits of its token and ours differ by less than NEAR_TIE, or `relative` times the
    reference logit's size (a real model's logits, 10-30, are rounded by bfloat16 to 2**-8 of that: 0.06-0.12); the
    comparison of that sequence stops there. Returns how many sequences left."""
    diverged = 0
    for i, ((ref_tokens, ref_logits), our_tokens) in enumerate(zip(reference, ours, strict=True)):
        pos = next((p for p, (a, b) in enumerate(zip(ref_tokens, our_tokens, strict=True)) if a != b), None)
        if pos is None:
            continue
        ref_logit = float(ref_logits[pos, ref_tokens[pos]])
        gap = ref_logit - float(ref_logits[pos, our_tokens[pos]])
        near_tie = max(NEAR_TIE, relative * abs(ref_logit))
        assert gap < near_tie, f"prompt {i} position {pos}: raylm chose {our_tokens[pos]}, {gap:.4f} below " \
                               f"transformers' {ref_tokens[pos]} (logit {ref_logit:.3f}): not a near-tie"
        diverged += 1
    return diverged
