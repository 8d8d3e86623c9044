"""GPT-OSS's experts under expert parallel: two lock-step DP ranks over gloo, two of the four experts each, route their
own tokens through the variable-size all_to_all (an eager forward) and the fixed-capacity one (a forward planned as a
FULL graph), with uneven loads; each rank's output equals transformers' GptOssMLP on its tokens, biases and the
clamped SwiGLU included (the biases are added by the rank holding the pair's expert)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from raylm.runner.batch_descriptor import BatchDescriptor, CUDAGraphMode
from raylm.runner.distributed.fixed_capacity import dispatch_capacity
from raylm.runner.forward_context import set_forward_context
from raylm.runner.layers.gpt_oss_experts import GptOssExperts
from raylm.runner.parallel_state import destroy_model_parallel, init_distributed_environment, init_model_parallel
from tests.test_dp_utils import run_two_ranks
from tests.test_gpt_oss import SHAPES, widen

# Tokens of rank 0 and rank 1 per forward: uneven both ways, and equal.
LOADS = [(7, 3), (1, 4), (5, 5)]


def _experts_on_two_ranks(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(tp_size=1, dp_size=2, enable_expert_parallel=True)
    config = GptOssConfig(**SHAPES)
    torch.manual_seed(1)  # the same transformers MLP on both ranks
    mlp = GptOssMLP(config)
    widen(mlp)
    experts = GptOssExperts(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                            config.intermediate_size, config.swiglu_alpha, config.swiglu_limit)
    assert (experts.use_ep, experts.local_num_experts, experts.expert_start) == (True, 2, 2 * rank)
    for name, param in experts.named_parameters():
        param.weight_loader(param, getattr(mlp.experts, name).detach())  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(2)
    inputs = [[torch.randn(n, config.hidden_size, generator=generator) for n in tokens] for tokens in LOADS]
    with torch.no_grad():  # the clamp is reached
        everything = torch.cat([x for load in inputs for x in load])
        gate_up = everything @ mlp.experts.gate_up_proj + mlp.experts.gate_up_proj_bias[:, None]
    assert gate_up.abs().max() > 2 * config.swiglu_limit
    for tokens, load in zip(LOADS, inputs, strict=True):
        hidden, n = load[rank], tokens[rank]
        with torch.no_grad():
            expected, logits = mlp(hidden[None])[0][0], mlp.router(hidden)[0]
        eager = BatchDescriptor(n, n, n, True, CUDAGraphMode.NONE, num_tokens_across_dp=list(tokens))
        full = BatchDescriptor(n, max(tokens), n, True, CUDAGraphMode.FULL, num_tokens_across_dp=list(tokens))
        for plan, capacity in ((eager, None), (full, max(tokens))):
            with set_forward_context(None, plan.num_tokens_padded, plan), torch.no_grad():
                assert dispatch_capacity(n, 1) == capacity
                torch.testing.assert_close(experts(hidden, logits), expected, rtol=1e-5, atol=1e-5)
    (Path(out_dir) / f"rank{rank}").touch()
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_experts_under_expert_parallel_match_transformers(tmp_path: Path) -> None:
    run_two_ranks(_experts_on_two_ranks, str(tmp_path / "store"), str(tmp_path), timeout_s=120)
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"]
