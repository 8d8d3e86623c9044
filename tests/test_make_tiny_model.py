from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from raylm.cluster.models.tiny_model import _train_tokenizer_json, count_parameters, make_tiny_model

ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SAMPLE = "The quick brown fox jumped over 12 lazy dogs, didn't it?\n  Ünïcode ✓ 你好!"


@pytest.fixture(scope="module", params=sorted(ARCH_CLASSES))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch=arch)


def test_layout_and_config(built: tuple[str, Path]) -> None:
    arch, path = built
    files = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    for name in files:
        assert (path / name).is_file(), name
    assert not list(path.parent.glob(".*tmp*")), "temp folder left behind"
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [ARCH_CLASSES[arch]]
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    assert config.tie_word_embeddings is (arch != "llama")
    tok = AutoTokenizer.from_pretrained(path)
    assert config.vocab_size == len(tok) == 2048
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert len({config.bos_token_id, config.eos_token_id, config.pad_token_id}) == 3
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]


def test_model_loads_and_runs(built: tuple[str, Path]) -> None:
    arch, path = built
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == ARCH_CLASSES[arch]
    names = {name for name, _ in model.named_parameters()}
    assert ("model.layers.0.self_attn.q_proj.bias" in names) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) is (arch == "qwen3")
    assert count_parameters(path) == sum(p.numel() for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok(SAMPLE)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trip_and_chat_template(built: tuple[str, Path]) -> None:
    _, path = built
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    assert tok.decode(ids) == SAMPLE
    with_special = tok(SAMPLE)["input_ids"]
    assert with_special[0] == tok.bos_token_id and with_special[1:] == ids
    assert tok.decode(with_special, skip_special_tokens=True) == SAMPLE
    # AutoTokenizer may rebuild pipeline parts per model type (qwen2); it must still agree with tokenizer.json.
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(path / "tokenizer.json")).encode(SAMPLE).ids == with_special
    assert max(tok.get_vocab().values()) < len(tok)

    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str) and "hi" in prompt
    assert prompt.endswith("<|start|>assistant\n")
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert chat_ids.count(tok.bos_token_id) == 1
    assert tok.convert_tokens_to_ids("<|start|>") in chat_ids and tok.convert_tokens_to_ids("<|end|>") in chat_ids


def test_deterministic(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=3)
    _train_tokenizer_json.cache_clear()  # also check that tokenizer training itself is deterministic
    b = make_tiny_model(tmp_path / "b", seed=3)
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / name).read_text() == (b / name).read_text(), name
    c = load_file(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert not torch.equal(ta["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_skips_existing_unless_forced(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m")
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert make_tiny_model(path) == path
    assert time.perf_counter() - start < 0.1
    assert weights.stat().st_mtime_ns == mtime
    make_tiny_model(path, force=True, num_layers=1)
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_llama3_rope_scaling_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from raylm.cluster.models.tiny_model import main

    out = tmp_path / "rs"
    main(["--out", str(out), "--rope-scaling", "llama3", "--tie-word-embeddings", "--num-layers", "1"])
    assert str(out) in capsys.readouterr().out
    config = AutoConfig.from_pretrained(out)
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 256
    assert config.tie_word_embeddings is True and config.num_hidden_layers == 1
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[0, 5, 6, 7]])).logits).all()
