"""A 107M Llama of the benchmark's `100m` shape whose greedy continuation copies a passage that recurs in its prompt:
the speculative-decoding benchmark's target (scripts/bench_spec.py). Random weights never copy, and training one on
two CPU cores takes hours, so two of its layers are set by hand to an induction circuit; the other ten keep their
random weights at a small scale. Its cost per token is exactly the random 107M model's (same shapes, dense weights).

The circuit, in a residual stream of 768 dimensions (token codes: random unit vectors in 27 of them):
- layer 0: two previous-token heads. Their queries and keys are constant (a constant input dimension), so RoPE alone
  sets their scores: sum_j a_j cos(theta_j (offset - d)), peaked at offset d = 1 and 2 over the first four frequency
  pairs. They write the codes of tokens t-1 and t-2 into their own dimensions.
- layer 1: an induction head over the position-free frequency pairs (rope_theta 1e30 makes pairs 4..31 rotate by
  under 0.1 rad over 500 positions). Query (code t, code t-1) meets key (code j-1, code j-2): a position j whose
  preceding bigram is the current one scores 2, a lone token match about 1; the BOS position scores a fixed 1.8 and
  has no value, so without a bigram match the head outputs nothing. The head writes the code of token j.
- the LM head scores every token's code against that output: the token after the earlier occurrence of the current
  bigram wins by a wide margin; with no match every token scores about the same (a near-uniform distribution).
So the model repeats a passage once two of its tokens recur, and otherwise emits unrelated tokens (sampling), the two
workloads of the benchmark. Its first two layers are a draft model that carries the whole circuit.

    python scripts/make_copy_model.py [--out models/bench-100m-copy]
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_common import MODELS_DIR, preset_model  # noqa: E402

CODE_DIMS = 27
E, C, S = slice(0, 27), 27, 28  # token code, constant, BOS flag
P1, P2, OUT = slice(32, 59), slice(64, 91), slice(96, 123)  # codes of t-1, t-2; the induction head's output
ROPE_THETA = 1e30
# Previous-token heads: weights of frequency pairs 0..3 (they maximise the smallest gap between the score at the
# wanted offset and at any other offset below 1100, here 0.083 of the peak) and the peak score.
POSITIONAL_WEIGHTS = np.array([0.189, 0.331, 0.199, 0.281])
POSITIONAL_PEAK = 300.0
INDUCTION_SCALE = 120.0  # score per unit of code similarity
SINK_THRESHOLD = 1.8  # BOS's score: between a lone token match (~1.6 at most) and a bigram match (2)
LM_HEAD_SCALE = 60.0
NOISE_SCALE = 0.05  # layers 2..11: random weights, their output projections scaled by this


def write_copy_model(out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    base = preset_model("100m")
    out.mkdir(parents=True, exist_ok=True)
    for file in base.iterdir():
        if file.name != "model.safetensors":
            shutil.copy2(file, out / file.name)
    config = json.loads((base / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        _set_weights(model, config, np.random.default_rng(seed))
    model.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # save_pretrained rewrites it
    return out


def _set_weights(model: torch.nn.Module, config: dict, rng: np.random.Generator) -> None:
    hidden, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    layers = model.model.layers
    codes = rng.standard_normal((vocab, CODE_DIMS))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    codes_t = torch.tensor(codes, dtype=torch.float32)
    bos = config["bos_token_id"]
    embed = torch.zeros(vocab, hidden)
    embed[:, E] = codes_t
    embed[:, C] = 1.0
    embed[bos, E] = 0.0
    embed[bos, S] = 1.0  # every row has norm sqrt(2): one RMSNorm scale for all
    model.model.embed_tokens.weight.copy_(embed)
    for layer in layers[2:]:  # the rest: random, small
        layer.self_attn.o_proj.weight.mul_(NOISE_SCALE)
        layer.mlp.down_proj.weight.mul_(NOISE_SCALE)
    for layer in layers[:2]:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                     layer.mlp.down_proj):
            proj.weight.zero_()
        layer.input_layernorm.weight.fill_(1.0)

    inv_freq = ROPE_THETA ** (-np.arange(0, head_dim, 2) / head_dim)
    norm0 = math.sqrt(hidden / 2)  # RMSNorm's factor at layer 0 (inputs of norm sqrt(2))
    attn0 = layers[0].self_attn
    for q_head, kv_head, offset, target in ((0, 0, 1, P1), (3, 1, 2, P2)):
        for pair, weight in enumerate(POSITIONAL_WEIGHTS):
            amplitude = math.sqrt(math.sqrt(head_dim) * POSITIONAL_PEAK * weight)
            angle = inv_freq[pair] * offset
            attn0.q_proj.weight[q_head * head_dim + pair, C] = amplitude / norm0
            attn0.k_proj.weight[kv_head * head_dim + pair, C] = amplitude * math.cos(angle) / norm0
            attn0.k_proj.weight[kv_head * head_dim + pair + head_dim // 2, C] = amplitude * math.sin(angle) / norm0
        for i in range(CODE_DIMS):
            attn0.v_proj.weight[kv_head * head_dim + i, E.start + i] = 1.0 / norm0
            attn0.o_proj.weight[target.start + i, q_head * head_dim + i] = 1.0

    # Layer 1 sees norm 2 (code, constant, t-1, t-2; BOS: code-free, flag) except at BOS (sqrt(2)).
    norm1, norm1_bos = math.sqrt(hidden / 4), math.sqrt(hidden / 2)
    attn1, q_head, kv_head = layers[1].self_attn, 6, 2
    free = [d for pair in range(4, head_dim // 2) for d in (pair, pair + head_dim // 2)]  # position-free dims
    amplitude = math.sqrt(math.sqrt(head_dim) * INDUCTION_SCALE)
    for i in range(CODE_DIMS):
        a, b = free[i], free[CODE_DIMS + i]
        attn1.q_proj.weight[q_head * head_dim + a, E.start + i] = amplitude / norm1
        attn1.k_proj.weight[kv_head * head_dim + a, P1.start + i] = amplitude / norm1
        attn1.q_proj.weight[q_head * head_dim + b, P1.start + i] = amplitude / norm1
        attn1.k_proj.weight[kv_head * head_dim + b, P2.start + i] = amplitude / norm1
        attn1.v_proj.weight[kv_head * head_dim + i, E.start + i] = 1.0 / norm1
        attn1.o_proj.weight[OUT.start + i, q_head * head_dim + i] = 1.0
    sink = free[2 * CODE_DIMS]
    attn1.q_proj.weight[q_head * head_dim + sink, C] = amplitude / norm1
    attn1.k_proj.weight[kv_head * head_dim + sink, S] = amplitude * SINK_THRESHOLD / norm1_bos

    # Final norm sees norm sqrt(5) (the four above and the copied code); the LM head reads the copied code only.
    model.model.norm.weight.fill_(1.0)
    lm_head = torch.zeros(vocab, hidden)
    lm_head[:, OUT] = codes_t * LM_HEAD_SCALE / math.sqrt(hidden / 5)
    model.lm_head.weight.copy_(lm_head)


def copy_model() -> Path:
    """The checkpoint, built once under models/."""
    out = MODELS_DIR / "bench-100m-copy"
    if not (out / "model.safetensors").exists():
        write_copy_model(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MODELS_DIR / "bench-100m-copy")
    args = parser.parse_args()
    print(write_copy_model(args.out))


if __name__ == "__main__":
    main()
