"""MoE: FusedMoE's routing and grouped matmul against naive references, Mixtral and Qwen3-MoE greedy parity with
transformers, TP=2 with TP-sharded experts and with expert parallel (all_to_all between the TP ranks) token-exact
with one device, expert checkpoint layouts, and All2AllManager dispatch/combine over gloo."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from raylm.cluster import LLM, SamplingParams
from raylm.runner.distributed import combine_topk, get_all2all_manager
from raylm.runner.layers.fused_moe import FusedMoE, grouped_expert_mlp, select_experts, why_grouped_mm_syncs
from raylm.runner.models.loader import load_model
from raylm.runner.parallel_state import (
    destroy_model_parallel,
    get_ep_group,
    init_distributed_environment,
    init_model_parallel,
)
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, hf_greedy

MAX_TOKENS = 10
PROMPT_LENGTHS = [1, 5, 23, 40]
ENGINE = dict(max_model_len=128, block_size=8, max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=False)
ARCHS = ["mixtral", "qwen3_moe"]
Result = list[tuple[list[int], list[dict[int, float]]]]


def make_prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def generate(llm: LLM) -> Result:
    """All prompts together, then the 1-token prompt alone: its decode steps carry one token, so with TP=2 and expert
    parallel one TP rank's token slice is empty."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    outputs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.fixture
def one_device() -> None:
    """A world of one, whatever an earlier test left."""
    destroy_model_parallel()
    init_model_parallel()


def naive_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """Per token, per chosen expert: the textbook formula."""
    out = torch.zeros_like(x)
    probs = torch.softmax(router_logits.double(), dim=-1)
    for t in range(x.shape[0]):
        weights, ids = probs[t].topk(top_k)
        weights = weights / weights.sum() if renormalize else weights
        for weight, e in zip(weights.tolist(), ids.tolist()):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += (weight * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))).to(x.dtype)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_per_token_reference(renormalize: bool, one_device: None) -> None:
    torch.manual_seed(0)
    num_experts, top_k, hidden, inter = 5, 3, 16, 24
    moe = FusedMoE(num_experts, top_k, hidden, inter, renormalize)
    moe.w13_weight.data.normal_(0, 0.3)
    moe.w2_weight.data.normal_(0, 0.3)
    for num_tokens in (0, 1, 37):
        x, logits = torch.randn(num_tokens, hidden), torch.randn(num_tokens, num_experts)
        expected = naive_moe(x, logits, moe.w13_weight, moe.w2_weight, top_k, renormalize)
        torch.testing.assert_close(moe(x, logits), expected, atol=1e-5, rtol=1e-5)
    # Rows in, rows out, in the caller's order, whatever the expert order.
    x, ids = torch.randn(9, hidden), torch.tensor([4, 0, 4, 2, 0, 0, 3, 4, 2])
    rows = grouped_expert_mlp(x, ids, moe.w13_weight, moe.w2_weight, moe.act_fn)
    for i, e in enumerate(ids.tolist()):
        gate, up = (moe.w13_weight[e] @ x[i]).chunk(2)
        torch.testing.assert_close(rows[i], moe.w2_weight[e] @ (torch.nn.functional.silu(gate) * up))


def test_router_matches_transformers() -> None:
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(1)
    hidden = torch.randn(50, 32)
    for router, renormalize in [
        (MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)), True),
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3)), False),
    ]:
        nn.init.normal_(router.weight)
        logits, ref_weights, ref_ids = router(hidden)
        weights, ids = select_experts(logits, router.top_k, renormalize)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


@pytest.fixture(scope="module")
def single_device(moe_checkpoints: dict[str, Path]) -> dict[str, Result]:
    results = {}
    for arch in ARCHS:
        llm = LLM(model=str(moe_checkpoints[arch]), **ENGINE)
        results[arch] = generate(llm)
        llm.shutdown()
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch: str, moe_checkpoints: dict[str, Path],
                                     single_device: dict[str, Result]) -> None:
    prompts = make_prompts()
    reference = hf_greedy(moe_checkpoints[arch], prompts + prompts[:1], MAX_TOKENS)
    # Random tiny weights give near-ties now and then (none with this seed and these prompts).
    assert check_logprobs_close(reference, single_device[arch], arch) <= 1



@pytest.mark.slow
@pytest.mark.parametrize(("arch", "expert_parallel"), [("mixtral", False), ("qwen3_moe", True)],
                         ids=["mixtral-tp2", "qwen3_moe-tp2-ep"])
def test_tp2_matches_single_device(arch: str, expert_parallel: bool, ray_cluster: Any,
                                   moe_checkpoints: dict[str, Path], single_device: dict[str, Result]) -> None:
    llm = LLM(model=str(moe_checkpoints[arch]), tensor_parallel_size=2, distributed_executor_backend="ray",
              enable_expert_parallel=expert_parallel, **ENGINE)
    experts = llm.llm_engine.engine_core.executor.collective_rpc(
        lambda worker: [(m.local_num_experts, m.expert_start, m.intermediate_size_per_partition)
                        for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)][-1])
    inter = 128 if arch == "mixtral" else 64
    assert experts == ([(2, 0, inter), (2, 2, inter)] if expert_parallel else [(4, 0, inter // 2)] * 2)
    ours = generate(llm)
    llm.shutdown()
    assert_same_output(ours, single_device[arch])


def loaded_params(path: Path) -> dict[str, torch.Tensor]:
    model = load_model(path, AutoConfig.from_pretrained(path))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("arch", "block", "names"), [("mixtral", "block_sparse_moe", ("w1", "w2", "w3")),
                                                     ("qwen3_moe", "mlp", ("gate_proj", "down_proj", "up_proj"))])
def test_per_expert_and_fused_layouts_load_the_same(arch: str, block: str, names: tuple[str, str, str],
                                                    moe_checkpoints: dict[str, Path], tmp_path: Path,
                                                    one_device: None) -> None:
    gate, down, up = names
    src = moe_checkpoints[arch]
    tensors = load_file(src / "model.safetensors")
    expert = f"model.layers.1.{block}.experts"
    assert f"{expert}.3.{gate}.weight" in tensors  # the per-expert layout is what save_pretrained writes
    # transformers 5's in-memory layout (save_original_format=False): one tensor per projection, the block `mlp`.
    fused = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in tensors.items() if ".experts." not in name}
    for layer in (0, 1) if arch == "mixtral" else (1,):  # Qwen3-MoE's layer 0 is dense
        experts = f"model.layers.{layer}.{block}.experts"
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{experts}.{e}.{gate}.weight"], tensors[f"{experts}.{e}.{up}.weight"]])
             for e in range(4)])
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{experts}.{e}.{down}.weight"] for e in range(4)])
    shutil.copytree(src, tmp_path / arch)
    save_file(fused, tmp_path / arch / "model.safetensors")
    per_expert, from_fused = loaded_params(src), loaded_params(tmp_path / arch)
    assert per_expert.keys() == from_fused.keys()
    assert all(torch.equal(per_expert[name], from_fused[name]) for name in per_expert)
    w13, w2 = per_expert["model.layers.1.mlp.experts.w13_weight"], per_expert["model.layers.1.mlp.experts.w2_weight"]
    assert torch.equal(w13[2], torch.cat([tensors[f"{expert}.2.{gate}.weight"], tensors[f"{expert}.2.{up}.weight"]]))
    assert torch.equal(w2[3], tensors[f"{expert}.3.{down}.weight"])


def _drop(name: str) -> str | None:
    return None if ".experts.2.w1." in name else name


def _transpose(tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    tensors[name] = tensors[name].t().contiguous()


@pytest.mark.parametrize(("rename", "error"), [
    (lambda name: name.replace(".experts.3.w1.", ".experts.7.w1."), "expert 7 is out of range for the config's 4"),
    (lambda name: name.replace(".experts.0.w3.", ".experts.0.w4."), "unknown expert projection 'w4'"),
    (lambda name: name.replace(".experts.1.w2.weight", ".experts.1.w2.scale"), "not an expert weight this model"),
    (_drop, r"lacks weights for MixtralForCausalLM: .*layers.0.mlp.experts.w13_weight"),
    (_transpose, r"expert 1 w2: checkpoint tensor of shape \(128, 64\), expected \(64, 128\)"),
], ids=["expert_id", "projection", "suffix", "missing", "shape"])
def test_bad_expert_weight_raises(rename: Any, error: str, moe_checkpoints: dict[str, Path], tmp_path: Path,
                                  one_device: None) -> None:
    src = moe_checkpoints["mixtral"]
    shutil.copytree(src, tmp_path / "bad")
    tensors = load_file(src / "model.safetensors")
    if rename is _transpose:
        _transpose(tensors)
    else:
        tensors = {rename(name): t for name, t in tensors.items() if rename(name) is not None}
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ValueError, match=error):
        load_model(tmp_path / "bad", AutoConfig.from_pretrained(tmp_path / "bad"))


def _scaled_by_expert(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What dispatch -> (expert e multiplies its rows by e + 1) -> combine must give."""
    return sum(weights[:, j:j + 1] * x * (ids[:, j:j + 1] + 1) for j in range(ids.shape[1]))


def _all2all_worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(tp_size=2, enable_expert_parallel=True)
    manager = get_all2all_manager(get_ep_group(), num_experts=6)  # experts 0-2 on rank 0, 3-5 on rank 1
    assert manager.num_local_experts == 3
    gen = torch.Generator().manual_seed(0)  # the same inputs on both ranks: each takes its own
    # (tokens on rank 0, tokens on rank 1, highest expert id routed to): uneven, one side empty, all to rank 0's
    # experts (rank 1 receives nothing), nothing at all.
    for sizes, max_expert in [((7, 2), 6), ((5, 0), 6), ((0, 3), 6), ((4, 6), 3), ((0, 0), 6)]:
        inputs = [(torch.randn(n, 8, generator=gen), torch.rand(n, max_expert, generator=gen).argsort(dim=1)[:, :2],
                   torch.rand(n, 2, generator=gen)) for n in sizes]
        x, ids, weights = inputs[rank]
        rows, local_ids, handle = manager.dispatch(x, ids, weights)
        mine = sum(int(((i // 3) == rank).sum()) for _, i, _ in inputs)
        assert rows.shape == (mine, 8) and local_ids.shape == (mine,) and (local_ids < 3).all()
        combined = manager.combine(rows * (local_ids + 1 + 3 * rank)[:, None], handle)
        torch.testing.assert_close(combined, _scaled_by_expert(x, ids, weights))

    # FusedMoE under expert parallel (each TP rank routes its slice of the replicated tokens) against the grouped
    # matmul on all experts; with one token, rank 1's slice is empty.
    moe = FusedMoE(6, 2, 8, 12, renormalize=True)
    w13, w2 = torch.randn(6, 24, 8, generator=gen), torch.randn(6, 8, 12, generator=gen)
    for e in range(6):
        moe.weight_loader(moe.w13_weight, w13[e, :12], (e, "w1"))
        moe.weight_loader(moe.w13_weight, w13[e, 12:], (e, "w3"))
        moe.weight_loader(moe.w2_weight, w2[e], (e, "w2"))
    assert torch.equal(moe.w13_weight, w13[3 * rank:3 * rank + 3])
    for num_tokens in (0, 1, 7):
        x, logits = torch.randn(num_tokens, 8, generator=gen), torch.randn(num_tokens, 6, generator=gen)
        weights, ids = select_experts(logits, 2, True)
        pair_rows = torch.arange(2 * num_tokens) // 2
        expected = combine_topk(grouped_expert_mlp(x, ids.flatten(), w13, w2, moe.act_fn, pair_rows).view(-1, 2, 8),
                                weights)
        torch.testing.assert_close(moe(x, logits), expected)
    (Path(out_dir) / f"rank{rank}").touch()
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_all2all_dispatch_combine_over_gloo(tmp_path: Path) -> None:
    mp.start_processes(_all2all_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"]


def test_grouped_matmul_is_graph_safe_only_on_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's grouped matmul falls back to a matmul per expert (reading the row ranges on the host), MoE
    models run without FULL CUDA graphs, and the log says why."""
    cuda = torch.device("cuda")
    assert "bfloat16 on CUDA (here: cpu" in why_grouped_mm_syncs(torch.device("cpu"), torch.bfloat16)
    assert "(here: cuda, torch.float16)" in why_grouped_mm_syncs(cuda, torch.float16)
    for capability, graph_safe in (((8, 0), False), ((9, 0), True), ((10, 0), True), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert (why_grouped_mm_syncs(cuda, torch.bfloat16) is None) == graph_safe, capability
