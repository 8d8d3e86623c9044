"""Models loaded by runner.models.loader, run over the paged KV cache, against transformers' logits."""
from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_attention_torch import make_common_metadata
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from raylm.common.outputs import IntermediateTensors
from raylm.runner.attention import AttentionBackend, TorchAttentionBackend
from raylm.runner.forward_context import set_forward_context
from raylm.runner.layers.attention import Attention
from raylm.runner.models.llama import LlamaMLP
from raylm.runner.models.loader import load_model
from raylm.runner.models.registry import get_model_cls
from raylm.runner.models.utils import get_pp_indices
from raylm.runner.parallel_state import destroy_model_parallel, init_model_parallel

BLOCK_SIZE, NUM_BLOCKS, ATOL = 4, 64, 1e-4
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
KINDS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "llama_sharded": (LlamaConfig, {}),
    "llama3_rope": (LlamaConfig, {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama_tied": (LlamaConfig, {"tie_word_embeddings": True, "vocab_size": 500}),
    "llama_mqa": (LlamaConfig, {"num_key_value_heads": 1}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": False}),
    "qwen3": (Qwen3Config, {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3_bias": (Qwen3Config, {"head_dim": 32, "attention_bias": True, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, nn.Module]]:
    """kind -> (folder, the transformers model saved there). Weights are re-drawn wider than the default init,
    norms and biases included, so that a misplaced tensor shows in the logits."""
    root, built = tmp_path_factory.mktemp("model_checkpoints"), {}
    for i, (kind, (config_cls, overrides)) in enumerate(KINDS.items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config_cls(**{**TINY, **overrides}), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.1)
        model.save_pretrained(root / kind, max_shard_size="40KB" if kind == "llama_sharded" else "1GB")
        built[kind] = (root / kind, model)
    assert (root / "llama_sharded" / "model.safetensors.index.json").exists()
    return built


@pytest.fixture(autouse=True)
def _model_parallel() -> None:
    init_model_parallel(1, 1)


def _load(path: Path, pp_rank: int = 0, pp_size: int = 1) -> nn.Module:
    model = load_model(path, AutoConfig.from_pretrained(path), torch.float32, "cpu", pp_rank=pp_rank, pp_size=pp_size)
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.kv_cache = torch.zeros(TorchAttentionBackend().get_kv_cache_shape(
                NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_size))
    return model


@torch.inference_mode()
def _step(model: nn.Module, backend: AttentionBackend, tokens: list[list[int]], seq_lens: list[int],
          block_tables: list[list[int]], intermediate: IntermediateTensors | None = None
          ) -> torch.Tensor | IntermediateTensors:
    """One engine step: request i computes `tokens[i]`, the last tokens of its first seq_lens[i]."""
    common, positions = make_common_metadata([len(t) for t in tokens], seq_lens, block_tables, BLOCK_SIZE)
    input_ids = torch.tensor([t for req in tokens for t in req])
    with set_forward_context(backend.build(common), len(input_ids)):
        return model(input_ids, positions, intermediate)


@torch.inference_mode()
def _hf_logits(hf_model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0]


def _prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _block_tables(lengths: list[int]) -> list[list[int]]:
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    return [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]


def _assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < ATOL


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_then_decode_matches_transformers(kind: str, checkpoints: dict[str, tuple[Path, nn.Module]]) -> None:
    path, hf_model = checkpoints[kind]
    model, backend = _load(path), TorchAttentionBackend()
    prompts = _prompts([5, 17, 1], hf_model.config.vocab_size)
    tables = _block_tables([len(p) + 1 for p in prompts])
    logits = model.compute_logits(_step(model, backend, prompts, [len(p) for p in prompts], tables))
    assert logits.shape == (23, hf_model.config.vocab_size)
    starts = [0, 5, 22]
    for prompt, start in zip(prompts, starts, strict=True):
        _assert_close(logits[start:start + len(prompt)], _hf_logits(hf_model, prompt))

    next_tokens = [int(logits[start + len(p) - 1].argmax()) for p, start in zip(prompts, starts, strict=True)]
    decode = model.compute_logits(_step(model, backend, [[t] for t in next_tokens],
                                        [len(p) + 1 for p in prompts], tables))
    for i, (prompt, token) in enumerate(zip(prompts, next_tokens, strict=True)):
        _assert_close(decode[i], _hf_logits(hf_model, prompt + [token])[-1])


def test_mlp_in_token_chunks_matches_one_pass(checkpoints: dict[str, tuple[Path, nn.Module]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Long CPU batches run the MLP in token chunks (to keep its activation in cache); the result is the same."""
    path, hf_model = checkpoints["llama"]
    model, backend = _load(path), TorchAttentionBackend()
    monkeypatch.setattr(LlamaMLP, "cpu_chunk_tokens", 4)  # 17 tokens: chunks of 4, 4, 4, 4, 1
    prompt = _prompts([17], hf_model.config.vocab_size)[0]
    logits = model.compute_logits(_step(model, backend, [prompt], [17], _block_tables([17])))
    _assert_close(logits, _hf_logits(hf_model, prompt))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_chunked_prefill_matches_full_prompt(kind: str, checkpoints: dict[str, tuple[Path, nn.Module]]) -> None:
    path, hf_model = checkpoints[kind]
    model, backend = _load(path), TorchAttentionBackend()
    long, short = _prompts([17, 5], hf_model.config.vocab_size, seed=3)
    tables = _block_tables([17, 6])
    first = model.compute_logits(_step(model, backend, [long[:8], short], [8, 5], tables))
    token = int(first[-1].argmax())
    # The second chunk runs in the same step as the short request's decode.
    second = model.compute_logits(_step(model, backend, [long[8:], [token]], [17, 6], tables))
    _assert_close(torch.cat([first[:8], second[:9]]), _hf_logits(hf_model, long))
    _assert_close(second[9], _hf_logits(hf_model, short + [token])[-1])


def test_dummy_run_without_metadata(checkpoints: dict[str, tuple[Path, nn.Module]]) -> None:
    path, hf_model = checkpoints["llama"]
    model = _load(path)
    prompt = _prompts([11], hf_model.config.vocab_size)[0]
    with torch.inference_mode(), set_forward_context(None, len(prompt)):
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)))
    _assert_close(model.compute_logits(hidden), _hf_logits(hf_model, prompt))
    assert all(not layer.kv_cache.any() for layer in model.modules() if isinstance(layer, Attention))


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_pipeline_stages_match_transformers(kind: str, checkpoints: dict[str, tuple[Path, nn.Module]]) -> None:
    path, hf_model = checkpoints[kind]
    first, last, backend = _load(path, 0, 2), _load(path, 1, 2), TorchAttentionBackend()
    first_names, last_names = [n for n, _ in first.named_parameters()], [n for n, _ in last.named_parameters()]
    assert not any(name.startswith(("lm_head", "model.norm", "model.layers.1.")) for name in first_names)
    assert not any(name.startswith("model.layers.0.") for name in last_names)
    prompts = _prompts([6, 9], hf_model.config.vocab_size)
    tables = _block_tables([6, 9])
    intermediate = _step(first, backend, prompts, [6, 9], tables)
    assert isinstance(intermediate, IntermediateTensors)
    assert set(intermediate.tensors) == {"hidden_states", "residual"}
    logits = last.compute_logits(_step(last, backend, prompts, [6, 9], tables, intermediate))
    _assert_close(logits[:6], _hf_logits(hf_model, prompts[0]))
    _assert_close(logits[6:], _hf_logits(hf_model, prompts[1]))


def test_pp_layer_split() -> None:
    assert [get_pp_indices(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [get_pp_indices(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [get_pp_indices(7, r, 3, [1, 2, 4]) for r in range(3)] == [(0, 1), (1, 3), (3, 7)]
    with pytest.raises(ValueError, match="partition"):
        get_pp_indices(7, 0, 3, [1, 2, 3])
    with pytest.raises(ValueError, match="cannot be split"):
        get_pp_indices(2, 0, 3)


def test_unknown_architecture_and_missing_weight(checkpoints: dict[str, tuple[Path, nn.Module]],
                                                tmp_path: Path) -> None:
    path, hf_model = checkpoints["llama"]
    config = AutoConfig.from_pretrained(path)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        get_model_cls(config)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights .*model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(tmp_path, AutoConfig.from_pretrained(tmp_path), torch.float32, "cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world_size: int, port: int, paths: list[str], out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    destroy_model_parallel()
    init_model_parallel(tp_size=world_size)
    for i, path in enumerate(paths):
        model, backend = _load(Path(path)), TorchAttentionBackend()
        config = AutoConfig.from_pretrained(path)
        prompts = _prompts([5, 9], config.vocab_size)
        tables = _block_tables([6, 10])
        prefill = model.compute_logits(_step(model, backend, prompts, [5, 9], tables))
        decode = model.compute_logits(_step(model, backend, [[7], [8]], [6, 10], tables))
        torch.save({"prefill": prefill, "decode": decode}, Path(out_dir) / f"{i}_{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_matches_transformers(checkpoints: dict[str, tuple[Path, nn.Module]], tmp_path: Path) -> None:
    """TP=2 over gloo: KV heads split (llama, qwen3), replicated (one KV head), vocab padding + tied head."""
    kinds = ["llama", "llama_mqa", "qwen3_bias", "llama_tied"]
    paths = [str(checkpoints[k][0]) for k in kinds]
    mp.start_processes(_tp_worker, args=(2, _free_port(), paths, str(tmp_path)), nprocs=2, start_method="spawn")
    for i, kind in enumerate(kinds):
        hf_model = checkpoints[kind][1]
        vocab = json.loads((Path(paths[i]) / "config.json").read_text())["vocab_size"]
        prompts = _prompts([5, 9], vocab)
        for rank in range(2):
            out = torch.load(tmp_path / f"{i}_{rank}.pt")
            _assert_close(out["prefill"][:5], _hf_logits(hf_model, prompts[0]))
            _assert_close(out["prefill"][5:], _hf_logits(hf_model, prompts[1]))
            _assert_close(out["decode"][0], _hf_logits(hf_model, prompts[0] + [7])[-1])
            _assert_close(out["decode"][1], _hf_logits(hf_model, prompts[1] + [8])[-1])
