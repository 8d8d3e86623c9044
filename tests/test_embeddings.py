"""Embeddings: pooling requests (LLM.embed, /v1/embeddings) on the engine that generates, checked against transformers'
hidden states pooled as the checkpoint's sentence-transformers config says (or the pooler_config setting)."""
from __future__ import annotations

import argparse
import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.cluster.engine.outputs import PoolingRequestOutput, RequestOutput
from raylm.cluster.engine.pooling_checks import check_pooling_params
from raylm.cluster.entrypoints.llm import LLM
from raylm.common.outputs import SchedulerOutput
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams
from raylm.configs import make_engine_config
from raylm.configs.loader import add_engine_args, engine_args_from
from raylm.configs.pooler_config import POOLING_TYPES, PoolerConfig, PoolingType, resolve_pooler_config
from tests.http_server import MAX_MODEL_LEN, Server, served_engine

# The longer prompt spans two KV blocks, and two steps of max_num_batched_tokens=32 (chunked prefill).
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 100, 200, 300, 17, 18, 250, 251, *range(90, 120)]]
SETTINGS: dict[str, Any] = {"max_model_len": 128, "block_size": 16, "num_gpu_blocks_override": 64, "max_num_seqs": 8,
                            "max_num_batched_tokens": 32, "distributed_executor_backend": "uni",
                            "disable_log_stats": True}
HIDDEN_SIZE = 128  # make_tiny_model's


def with_pooling(source: Path, folder: Path, mode: str | None, normalize: bool,
                 config: dict[str, Any] | None = None) -> Path:
    """A copy of the checkpoint as sentence-transformers writes an embedding model: modules.json naming a Pooling
    module (its 1_Pooling/config.json's `mode`) and a Normalize module when `normalize`; `config` added to
    config.json."""
    shutil.copytree(source, folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (folder / "1_Pooling").mkdir()
        modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
                 "lasttoken")
        pooling = {f"pooling_mode_{m}": m == mode for m in modes}
        config_json = {"word_embedding_dimension": HIDDEN_SIZE, **pooling}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(config_json))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    if config:
        config_file = folder / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    return folder


def reference(path: Path, prompts: list[list[int]], pooling_type: str, normalize: bool) -> list[torch.Tensor]:
    """transformers' last_hidden_state of each prompt, pooled."""
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    vectors = []
    with torch.no_grad():
        for ids in prompts:
            states = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[pooling_type]
            vectors.append(F.normalize(vector, dim=0) if normalize else vector)
    return vectors


def assert_close(got: list[float] | torch.Tensor, expected: torch.Tensor) -> None:
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    assert F.cosine_similarity(got, expected, dim=0).item() >= 0.9999
    torch.testing.assert_close(got.norm(), expected.norm(), rtol=1e-4, atol=1e-5)


def assert_same(left: Any, right: Any) -> None:
    """The same vectors, to float32 rounding: a value's last bits depend on which requests shared its step."""
    assert len(left.data) == len(right.data)
    for a, b in zip(left.data, right.data):
        np.testing.assert_allclose(a.embedding, b.embedding, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["qwen3"]


@pytest.mark.parametrize(("mode", "normalize", "expected"), [
    ("lasttoken", True, ("LAST", True)), ("mean_tokens", False, ("MEAN", False)), ("cls_token", True, ("CLS", True)),
    (None, False, ("LAST", False))])  # no Pooling module: vLLM's default, LAST
def test_pooler_config_from_sentence_transformers_files(qwen3: Path, tmp_path: Path, mode: str | None,
                                                        normalize: bool, expected: tuple[str, bool]) -> None:
    path = with_pooling(qwen3, tmp_path / "model", mode, normalize)
    resolved = resolve_pooler_config(None, str(path))
    assert (resolved.pooling_type, resolved.normalize) == expected
    override = resolve_pooler_config(PoolerConfig(normalize=not normalize), str(path))  # field by field
    assert (override.pooling_type, override.normalize) == (expected[0], not normalize)
    plain = resolve_pooler_config(None, str(qwen3))  # no modules.json: a decoder embedding model's defaults
    assert (plain.pooling_type, plain.normalize) == ("LAST", True)


def test_a_pooling_mode_raylm_lacks_needs_pooler_config(qwen3: Path, tmp_path: Path) -> None:
    path = with_pooling(qwen3, tmp_path / "model", "max_tokens", True)
    with pytest.raises(ValueError, match=r"names the pooling modes \['pooling_mode_max_tokens'\].*pooler_config"):
        resolve_pooler_config(None, str(path))
    assert resolve_pooler_config(PoolerConfig(pooling_type="MEAN"), str(path)).pooling_type == "MEAN"


def test_pooler_config_on_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--pooler-config", '{"pooling_type": "MEAN", "normalize": false}'])
    config = make_engine_config(**engine_args_from(args))
    assert config.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=False)
    with pytest.raises(ValueError, match="pooler_config.pooling_type"):
        make_engine_config(pooler_config={"pooling_type": "MAX"})


def test_pooling_params_checked_against_the_engine(qwen3: Path, tmp_path: Path) -> None:
    matryoshka = with_pooling(qwen3, tmp_path / "model", "mean_tokens", False, {"is_matryoshka": True})
    config = resolve_engine_config(make_engine_config(model=str(matryoshka), **SETTINGS))
    filled = check_pooling_params(PoolingParams(dimensions=HIDDEN_SIZE), config)  # the model's pooler fills the rest
    assert filled == PoolingParams(dimensions=HIDDEN_SIZE, normalize=False, pooling_type="MEAN")
    with pytest.raises(ValueError, match="more than the model's hidden size"):
        check_pooling_params(PoolingParams(dimensions=HIDDEN_SIZE + 1), config)
    with pytest.raises(ValueError, match="PoolingParams.dimensions must be >= 1"):
        PoolingParams(dimensions=0)
    drafting = resolve_engine_config(make_engine_config(
        model=str(matryoshka), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **SETTINGS))
    with pytest.raises(ValueError, match="speculative_config"):
        check_pooling_params(PoolingParams(), drafting)


def test_embed_equals_transformers_pooled_hidden_states(qwen3: Path, tmp_path: Path) -> None:
    """Every pooling type, normalised and not, in one batch (PoolingParams per prompt)."""
    path = with_pooling(qwen3, tmp_path / "model", "lasttoken", True)  # Qwen3-Embedding's pooling
    kinds: list[tuple[PoolingType, bool]] = [(pooling_type, normalize) for pooling_type in POOLING_TYPES
                                             for normalize in (True, False)]
    llm = LLM(str(path), **SETTINGS)
    try:
        default = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
        pooled = llm.embed([{"prompt_token_ids": ids} for _ in kinds for ids in PROMPTS],
                           [PoolingParams(pooling_type=t, normalize=n) for t, n in kinds for _ in PROMPTS],
                           use_tqdm=False)
    finally:
        llm.shutdown()
    assert [output.prompt_token_ids for output in default] == PROMPTS
    for output, expected in zip(default, reference(path, PROMPTS, "LAST", True)):
        assert output.finished and output.outputs.hidden_size == HIDDEN_SIZE
        assert_close(output.outputs.embedding, expected)
    vectors = [vector for t, n in kinds for vector in reference(path, PROMPTS, t, n)]
    for output, vector in zip(pooled, vectors, strict=True):
        assert_close(output.outputs.embedding, vector)


def test_pooler_config_setting_and_limits(qwen3: Path, tmp_path: Path) -> None:
    path = with_pooling(qwen3, tmp_path / "model", "lasttoken", True)
    llm = LLM(str(path), pooler_config={"pooling_type": "MEAN", "normalize": False}, **SETTINGS)
    try:
        mean = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
        full = llm.embed({"prompt_token_ids": list(range(128))}, use_tqdm=False)  # an input may fill max_model_len
        with pytest.raises(ValueError, match="at most max_model_len"):
            llm.embed({"prompt_token_ids": list(range(129))}, use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions: .* does not support matryoshka"):
            llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=8))
    finally:
        llm.shutdown()
    for output, expected in zip([*mean, *full], reference(path, [*PROMPTS, list(range(128))], "MEAN", False)):
        assert_close(output.outputs.embedding, expected)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_embeddings_share_steps_with_generation(qwen3: Path, tmp_path: Path, async_scheduling: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Pooling requests scheduled beside generation requests, on one engine: the pooled vectors are transformers',
    and the generated tokens are those the engine generates with no pooling request beside them."""
    path = with_pooling(qwen3, tmp_path / "model", "mean_tokens", False)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    gen_prompts = [[11, 12, 13], list(range(100, 130))]
    llm = LLM(str(path), async_scheduling=async_scheduling, enable_prefix_caching=False, **SETTINGS)
    try:
        alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in gen_prompts],
                                                              greedy, use_tqdm=False)]
        engine = llm.llm_engine
        for i, ids in enumerate(gen_prompts):
            engine.add_request(f"gen-{i}", {"prompt_token_ids": ids}, greedy, output_kind="final")
        for i, ids in enumerate(PROMPTS):
            engine.add_request(f"embed-{i}", {"prompt_token_ids": ids}, PoolingParams())
        scheduler = engine.engine_core.scheduler  # type: ignore[union-attr]
        steps: list[set[str]] = []  # the requests each step scheduled
        schedule = scheduler.schedule

        def recording_schedule() -> SchedulerOutput:
            output = schedule()
            steps.append(set(output.num_scheduled_tokens))
            return output

        monkeypatch.setattr(scheduler, "schedule", recording_schedule)  # the real one, its outputs recorded
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        while engine.has_unfinished_requests():
            finished.update((output.request_id, output) for output in engine.step() if output.finished)
    finally:
        llm.shutdown()
    assert any({"gen-0", "embed-1"} <= step for step in steps)  # the embed request's prompt beside generation
    generated = [finished[f"gen-{i}"] for i in range(len(gen_prompts))]
    assert [o.outputs[0].token_ids for o in generated if isinstance(o, RequestOutput)] == alone
    for i, expected in enumerate(reference(path, PROMPTS, "MEAN", False)):
        output = finished[f"embed-{i}"]
        assert isinstance(output, PoolingRequestOutput)
        assert_close(output.outputs.data, expected)


def test_a_preempted_pooling_request_starts_again(qwen3: Path) -> None:
    """A KV pool of 8 blocks: the decodes preempt the MEAN request part-way through its prompt, again and again; its
    running sum starts again with it, and the vector is transformers'."""
    settings = {**SETTINGS, "num_gpu_blocks_override": 8, "enable_prefix_caching": False}
    llm = LLM(str(qwen3), **settings)
    embed_prompt = list(range(100, 170))
    try:
        engine = llm.llm_engine
        greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        for i, ids in enumerate([list(range(10, 40)), list(range(50, 80))]):
            engine.add_request(f"gen-{i}", {"prompt_token_ids": ids}, greedy, output_kind="final")
        engine.add_request("embed", {"prompt_token_ids": embed_prompt}, PoolingParams(pooling_type="MEAN",
                                                                                     normalize=False))
        scheduler = engine.engine_core.scheduler  # type: ignore[union-attr]
        preempted = 0
        pooled = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if isinstance(output, PoolingRequestOutput):
                    pooled = output.outputs.data
            if "embed" in scheduler.requests:
                preempted = scheduler.requests["embed"].num_preemptions
    finally:
        llm.shutdown()
    assert preempted >= 1 and pooled is not None
    assert_close(pooled, reference(qwen3, [embed_prompt], "MEAN", False)[0])


# ---- /v1/embeddings ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def matryoshka(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_pooling(qwen3, tmp_path_factory.mktemp("embed") / "model", "lasttoken", True,
                        {"matryoshka_dimensions": [16, 32, HIDDEN_SIZE]})


@pytest.fixture(scope="module")
def server(matryoshka: Path) -> Iterator[Server]:
    with served_engine(matryoshka) as (server, _):
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_openai_embeddings_float_base64_and_token_ids(client: openai.OpenAI, matryoshka: Path) -> None:
    from transformers import AutoTokenizer

    texts = ["The quick brown fox", "jumps"]
    token_ids = [AutoTokenizer.from_pretrained(matryoshka).encode(text) for text in texts]
    expected = reference(matryoshka, token_ids, "LAST", True)
    as_floats = client.embeddings.create(model=matryoshka.name, input=texts, encoding_format="float")
    assert as_floats.object == "list" and as_floats.model == matryoshka.name
    assert [d.index for d in as_floats.data] == [0, 1]
    for data, vector in zip(as_floats.data, expected):
        assert_close(data.embedding, vector)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, token_ids))
    # The client asks for base64 unless told otherwise, and decodes it: the same float32 values.
    as_base64 = client.embeddings.create(model=matryoshka.name, input=texts)
    assert_same(as_base64, as_floats)
    by_ids = client.embeddings.create(model=matryoshka.name, input=token_ids, encoding_format="float")
    assert_same(by_ids, as_floats)
    one = client.embeddings.create(model=matryoshka.name, input=token_ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, as_floats.data[1].embedding, rtol=0, atol=1e-5)


def test_openai_embeddings_raw_base64_and_dimensions(server: Server, matryoshka: Path) -> None:
    status, body = server.request("POST", "/v1/embeddings", {"input": [[7, 8, 9]], "encoding_format": "base64"})
    assert status == 200, body
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    (expected,) = reference(matryoshka, [[7, 8, 9]], "LAST", False)
    assert_close(torch.from_numpy(vector.copy()), F.normalize(expected, dim=0))
    status, body = server.request("POST", "/v1/embeddings", {"input": [7, 8, 9], "dimensions": 16})
    assert status == 200, body
    assert_close(body["data"][0]["embedding"], F.normalize(expected[:16], dim=0))  # cut, then normalised


@pytest.mark.parametrize(("body", "words"), [
    ({"input": list(range(MAX_MODEL_LEN + 1))},
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {MAX_MODEL_LEN + 1} tokens"),
    ({"input": [[1, 2], [600]]}, "outside the vocabulary"),
    ({"input": [1, 2], "dimensions": 20}, f"only supports [16, 32, {HIDDEN_SIZE}] matryoshka dimensions"),
    ({"input": ""}, "input"),
    ({"input": [1, 2], "encoding_format": "int8"}, "encoding_format"),
])
def test_openai_embeddings_refusals(server: Server, client: openai.OpenAI, matryoshka: Path, body: dict[str, Any],
                                    words: str) -> None:
    status, answer = server.request("POST", "/v1/embeddings", body)
    assert status == 400, answer
    assert words in answer["error"]["message"]
    if len(body["input"]) > MAX_MODEL_LEN:  # the client sees it as OpenAI's BadRequestError
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.embeddings.create(model=matryoshka.name, input=body["input"])


def test_openai_embeddings_of_a_lora_adapter(qwen3: Path, tmp_path: Path) -> None:
    """With enable_lora the adapters are models: `model` naming one pools the hidden states of the base model with
    the adapter applied (PEFT's), the base model's name those without."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.lora_utils import make_adapter

    adapter = make_adapter(qwen3, tmp_path / "sql", seed=3)
    ids = [[7, 8, 9, 10], list(range(200, 240))]
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32), adapter)
        decoder: Any = peft.get_base_model().model  # the adapted Qwen3Model: its last_hidden_state, post-norm
        expected = [F.normalize(decoder(torch.tensor([p])).last_hidden_state[0, -1], dim=0) for p in ids]
    with served_engine(qwen3, enable_lora=True, lora_modules=[f"sql={adapter}"]) as (server, _):
        status, body = server.request("POST", "/v1/embeddings", {"model": "sql", "input": ids})
        assert status == 200, body
        assert body["model"] == "sql"
        for data, vector in zip(body["data"], expected, strict=True):
            assert_close(data["embedding"], vector)
        status, base = server.request("POST", "/v1/embeddings", {"model": qwen3.name, "input": ids})
        assert status == 200, base
    for data, vector, adapted in zip(base["data"], reference(qwen3, ids, "LAST", True), expected, strict=True):
        assert_close(data["embedding"], vector)
        assert F.cosine_similarity(vector, adapted, dim=0).item() < 0.999  # the adapter changes the vector


def test_a_bare_decoder_checkpoint_loads(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-Embedding's layout: the decoder saved as `Qwen3Model` (no `model.` prefix, no lm_head: its embeddings
    are tied), config.json still naming Qwen3ForCausalLM; it pools as transformers' Qwen3Model does."""
    qwen3_path = checkpoints["qwen3"]
    source = tmp_path / "tied"
    config = json.loads((qwen3_path / "config.json").read_text())
    AutoModel.from_pretrained(qwen3_path, dtype=torch.float32, tie_word_embeddings=True).save_pretrained(source)
    config_file = source / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "architectures": config["architectures"],
                                       "tie_word_embeddings": True}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (qwen3_path / name).exists():
            shutil.copy(qwen3_path / name, source / name)
    bare = with_pooling(source, tmp_path / "bare", "lasttoken", True)
    llm = LLM(model=str(bare), **SETTINGS)
    try:
        outputs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    for output, expected in zip(outputs, reference(bare, PROMPTS, "LAST", True), strict=True):
        assert_close(output.outputs.embedding, expected)
