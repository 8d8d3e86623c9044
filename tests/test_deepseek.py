"""DeepSeek-V2 / V3 (multi-head latent attention, dense-then-MoE, group-limited and bias-corrected routing, YaRN
with DeepSeek's mscale) token-exact with transformers on tiny random checkpoints, through prefill, chunked prefill
(a prompt longer than one KV block and the step budget) and decode steps (MLA's absorbed form); the KV cache holds
the latent and the rope key only; TP=2 (heads split) x PP=2 with expert parallel on Ray equals one device."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_tokenizer import build_tokenizer
from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers
from raylm.runner.attention.torch_backend import DecodeGraphMetadata, TorchAttentionBackend
from raylm.runner.forward_context import set_forward_context
from raylm.runner.layers.expert_routing import DeepseekRouting
from raylm.runner.layers.mla_attention import MLAAttention
from tests.http_server import served_engine
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, hf_greedy
from tests.runner_steps import make_runner, model_parallel_of_one  # noqa: F401 (fixture)

MAX_TOKENS = 8
# 40 tokens: past one 16-token block and the 32-token step budget (a chunk reads cached latents); 5: a short prompt
# decoding beside the long one's chunks.
PROMPT_LENGTHS = (5, 40)
ENGINE = dict(max_model_len=128, block_size=16, enable_prefix_caching=False, max_num_batched_tokens=32)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707,
        "mscale_all_dim": 0.707, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}
SHAPES = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
              n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=128, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
# name -> (config class, the config's own fields): V2 without q-lora (q_proj), group-limited greedy routing, YaRN;
# V3 with q-lora, sigmoid routing with the correction bias and renormalised weights, neox-style rope halves.
KINDS: dict[str, tuple[Any, dict[str, Any]]] = {
    "v2": (DeepseekV2Config, dict(q_lora_rank=None, topk_method="group_limited_greedy", rope_parameters=YARN)),
    "v3": (DeepseekV3Config, dict(q_lora_rank=24, norm_topk_prob=True, rope_interleave=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
Result = list[tuple[list[int], list[dict[int, float]]]]


def write_checkpoint(path: Path, config_cls: Any, fields: dict[str, Any]) -> Path:
    """transformers' own model, its weights re-drawn wide (norms around 1, the rest std 0.1, the correction bias
    too) so that attention, the rope and the routing each decide tokens."""
    tokenizer = build_tokenizer(512)
    arch = "DeepseekV3ForCausalLM" if config_cls is DeepseekV3Config else "DeepseekV2ForCausalLM"
    config = config_cls(vocab_size=len(tokenizer), architectures=[arch], **SHAPES, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif tensor.is_floating_point() and "rotary" not in name:
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def generate(llm: LLM) -> Result:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def run(path: Path, **settings: Any) -> Result:
    llm = LLM(model=str(path), **{**ENGINE, **settings})
    try:
        return generate(llm)
    finally:
        llm.shutdown()


def assert_matches(reference: Result, ours: Result, name: str, tolerance: float = 1e-3) -> None:
    """The same greedy tokens, and every top-5 logprob both report within `tolerance` (float32 on both sides)."""
    assert check_logprobs_close(reference, ours, name) == 0
    for (_, ref_steps), (_, our_steps) in zip(reference, ours, strict=True):
        for ref_top, our_top in zip(ref_steps, our_steps, strict=True):
            for token in ref_top.keys() & our_top.keys():
                assert abs(ref_top[token] - our_top[token]) < tolerance, f"{name}: token {token}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: write_checkpoint(root / name, cls, fields) for name, (cls, fields) in KINDS.items()}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, Result]:
    return {name: hf_greedy(path, prompts(), MAX_TOKENS) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def single_device(checkpoints: dict[str, Path]) -> dict[str, Result]:
    """V2 on the cpu attention backend (whose metadata MLA regroups), V3 on the torch one (whose grouping it reads)."""
    return {"v2": run(checkpoints["v2"]), "v3": run(checkpoints["v3"], attention_backend="torch")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_matches_transformers(kind: str, references: dict[str, Result],
                                     single_device: dict[str, Result]) -> None:
    assert_matches(references[kind], single_device[kind], kind)


def test_served_completion_matches_transformers(checkpoints: dict[str, Path], references: dict[str, Result]) -> None:
    """The OpenAI server's /v1/completions over the V2 checkpoint: transformers' greedy text."""
    tokenizer = build_tokenizer(512)
    with served_engine(checkpoints["v2"], max_model_len=128) as (server, _):
        _, models = server.request("GET", "/v1/models")
        status, body = server.request("POST", "/v1/completions", {
            "model": models["data"][0]["id"], "prompt": prompts()[1], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True})
    assert status == 200, body
    text, expected = body["choices"][0]["text"], tokenizer.decode(references["v2"][1][0])
    # The detokenizer holds back a trailing incomplete UTF-8 sequence, which decode() shows as U+FFFD.
    assert len(text) > 0 and expected.startswith(text) and set(expected[len(text):]) <= {"\ufffd"}


def test_yarn_mscale_moves_the_outputs(checkpoints: dict[str, Path], references: dict[str, Result],
                                        tmp_path: Path) -> None:
    """Without mscale_all_dim (no softmax rescale, another cos/sin factor) transformers' logprobs move by more than
    assert_matches allows: the V2 parity above fails if raylm leaves it out."""
    changed = tmp_path / "no_mscale"
    shutil.copytree(checkpoints["v2"], changed)
    config = json.loads((changed / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "mscale_all_dim": 0}
    (changed / "config.json").write_text(json.dumps(config))
    moved = hf_greedy(changed, prompts(), MAX_TOKENS)
    assert any(abs(moved_top[t] - ref_top[t]) > 1e-2  # ten times assert_matches' tolerance
               for (_, moved_steps), (_, ref_steps) in zip(moved, references["v2"], strict=True)
               for moved_top, ref_top in zip(moved_steps, ref_steps, strict=True) for t in moved_top.keys() & ref_top)


def test_kv_cache_holds_latent_and_rope_key(checkpoints: dict[str, Path],
                                            model_parallel_of_one: None) -> None:  # noqa: F811
    """Bytes per token: (kv_lora_rank + qk_rope_head_dim) x 4 (float32) x layers, not heads x (k + v) widths."""
    runner = make_runner(checkpoints["v3"], num_blocks=8, block_size=16)
    per_token = (SHAPES["kv_lora_rank"] + SHAPES["qk_rope_head_dim"]) * 4 * SHAPES["num_hidden_layers"]
    assert runner.kv_cache_bytes_per_block() == 16 * per_token
    assert [tuple(cache.shape) for cache in runner.kv_caches] == [(8, 16, 40)] * 3
    full_heads = SHAPES["num_attention_heads"] * (16 + 8 + 16) * 4 * SHAPES["num_hidden_layers"]
    assert per_token * 4 == full_heads  # this tiny shape: a quarter of the full-head cache


def naive_mla(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, kv_b: torch.Tensor,
              scale: float) -> torch.Tensor:
    """One request's causal MLA, keys and values expanded per head: q [n, H, 24], latent [n, 32], k_pe [n, 8]."""
    kv = (latent @ kv_b.T).unflatten(-1, (4, 32))  # [n, H, nope + v]
    k = torch.cat([kv[..., :16], k_pe[:, None].expand(-1, 4, -1)], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    causal = torch.ones(len(q), len(q), dtype=torch.bool).tril()[len(q) - q.shape[0]:]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khv->qhv", probs, kv[..., 16:]).flatten(1)


def test_absorbed_decode_equals_expanded_attention() -> None:
    """Prompts of 5 and 7 tokens (blocks of 4), then one decode token each: the decode, absorbed, through the torch
    backend's grouping and through a CUDA graph's fixed buffers (the whole block table, no host read), equals
    attention with every key and value expanded from the latents."""
    torch.manual_seed(0)
    layer = MLAAttention(4, 0.3, 16, 8, 16, 32, layer_idx=0)
    layer.kv_cache = torch.zeros(8, 4, 40)
    kv_b, lens = torch.randn(4 * 32, 32) * 0.3, [6, 8]
    q = [torch.randn(n, 4, 24) for n in lens]
    latent, k_pe = [torch.randn(n, 32) for n in lens], [torch.randn(n, 8) for n in lens]
    block_table = torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32)
    slots = [torch.tensor([int(block_table[r, p // 4]) * 4 + p % 4 for p in range(n)]) for r, n in enumerate(lens)]

    def step(rows: list[slice], metadata_of: Any) -> torch.Tensor:
        parts = [(t[r][rows[r]]) for t in (q, latent, k_pe, slots) for r in range(2)]
        q_, latent_, k_pe_, slot = (torch.cat(parts[i:i + 2]) for i in range(0, 8, 2))
        query_lens = torch.tensor([len(range(n)[rows[r]]) for r, n in enumerate(lens)], dtype=torch.int32)
        seq_lens = torch.tensor([rows[r].stop or n for r, n in enumerate(lens)], dtype=torch.int32)
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0, dtype=torch.int32)])
        common = CommonAttentionMetadata(query_start_loc, query_start_loc, seq_lens, seq_lens, block_table, slot, 2,
                                         len(q_), int(query_lens.max()), int(seq_lens.max()))
        with set_forward_context(metadata_of(common), len(q_)):
            return layer(q_, latent_, k_pe_, kv_b)

    torch_build = TorchAttentionBackend().build
    step([slice(0, n - 1) for n in lens], torch_build)  # the prompts, fresh: their own entries
    expected = torch.stack([naive_mla(q[r], latent[r], k_pe[r], kv_b, 0.3)[-1] for r in range(2)])
    decode = [slice(n - 1, n) for n in lens]
    torch.testing.assert_close(step(decode, torch_build), expected)
    graph = step(decode, lambda c: DecodeGraphMetadata(TorchAttentionBackend(), 2, DecodeGraphBuffers(
        c.slot_mapping, c.seq_lens, c.query_start_loc, c.block_table, scratch_slot=-1)))
    torch.testing.assert_close(graph, expected)


def test_routing_against_transformers_routers() -> None:
    """The routing functions alone: the same experts and weights as transformers' routers on random logits."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(1)
    hidden = torch.randn(50, 64)
    for cls, config_cls, method in ((DeepseekV2TopkRouter, DeepseekV2Config, "group_limited_greedy"),
                                    (DeepseekV2TopkRouter, DeepseekV2Config, "greedy"),
                                    (DeepseekV3TopkRouter, DeepseekV3Config, "noaux_tc")):
        config = config_cls(**{**SHAPES, "num_experts_per_tok": 3}, topk_method=method, norm_topk_prob=True)
        router = cls(config)
        torch.nn.init.normal_(router.weight)
        bias = None
        if method == "noaux_tc":
            bias = router.e_score_correction_bias.normal_()
        logits, weights, ids = router(hidden)
        # transformers' V2 router never renormalises (its configs keep norm_topk_prob False); V3's does.
        ours = DeepseekRouting(3, method, 4, 2, method == "noaux_tc", 2.5, bias)(logits)
        order, our_order = ids.argsort(dim=-1), ours[1].argsort(dim=-1)
        assert torch.equal(ids.gather(1, order), ours[1].gather(1, our_order)), method
        torch.testing.assert_close(weights.gather(1, order), ours[0].gather(1, our_order))


def test_routing_of_no_tokens() -> None:
    """An expert-parallel TP rank whose slice of the batch is empty still routes (to nothing)."""
    for method, bias in (("noaux_tc", torch.zeros(8)), ("group_limited_greedy", None)):
        weights, ids = DeepseekRouting(2, method, 4, 2, True, 1.0, bias)(torch.empty(0, 8))
        assert weights.shape == ids.shape == (0, 2)


def test_routing_settings_that_cannot_run_are_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="topk_method: 'sqrtsoftplus' is not supported"):
        DeepseekRouting(2, "sqrtsoftplus", 1, 1, False, 1.0)
    changed = tmp_path / "three_groups"
    shutil.copytree(checkpoints["v2"], changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "n_group": 3}))
    with pytest.raises(ValueError, match="n_group: 3 groups cannot split n_routed_experts=8 evenly"):
        LLM(model=str(changed), **ENGINE)


def test_tp2_pp2_ep_on_ray_matches_single_device(ray_cluster: Any, checkpoints: dict[str, Path],
                                                single_device: dict[str, Result]) -> None:
    """TP=2: two of the four heads per rank (q / kv_b / o projections split, the latent projections replicated);
    PP=2: the dense layer and a MoE layer on stage one, the last MoE layer on stage two; expert parallel over the two
    TP ranks: four of the eight experts each, every rank routing its slice of the tokens by V3's bias-corrected
    top-k through the all_to_all."""
    ours = run(checkpoints["v3"], tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True,
               distributed_executor_backend="ray")
    assert_same_output(ours, single_device["v3"])
