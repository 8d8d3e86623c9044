"""How a composition cell runs: the checkpoint of each weights kind, the engine settings of a layout and a feature,
and one client per front end with the same two calls (`complete`, `chat`) answering in one shape."""
from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import torch
from safetensors.torch import load_file, save_file

from raylm import LLM, SamplingParams
from raylm.cluster.entrypoints.openai.api_server import build_engine_app
from raylm.common.structured_outputs import StructuredOutputsParams
from raylm.configs import make_engine_config
from tests.http_server import Server, wait_until

BASE_SETTINGS: dict[str, Any] = {"max_model_len": 256, "block_size": 16, "num_gpu_blocks_override": 96,
                                 "max_num_seqs": 16, "max_num_batched_tokens": 256}
LAYOUT_SETTINGS: dict[str, dict[str, Any]] = {"one": {}, "tp2": {"tensor_parallel_size": 2},
                                              "pp2": {"pipeline_parallel_size": 2}, "dp2": {"data_parallel_size": 2}}
ADAPTER = "adapter"


def bfloat16_copy(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` with its weights stored as bfloat16 (config.json saying so), as a bfloat16 release ships."""
    out.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            (out / item.name).write_bytes(item.read_bytes())
    tensors = {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in
               load_file(checkpoint / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def feature_settings(feature: str, draft: Path, adapter: Path) -> dict[str, Any]:
    """Engine settings a feature needs beyond the defaults (prefix caching is on by default)."""
    return {
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 2}},
        "draft_model": {"speculative_config": {"method": "draft_model", "model": str(draft),
                                               "num_speculative_tokens": 2}},
        "lora": {"enable_lora": True, "lora_modules": [f"{ADAPTER}={adapter}"], "max_lora_rank": 8},
        "priority": {"scheduling_policy": "priority"},
        "kv_offload": {"kv_offloading_size": 0.01},
    }.get(feature, {})


@dataclasses.dataclass
class Choice:
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None  # the sampled token's, per position


class OfflineClient:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.llm = LLM(**settings)

    def complete(self, prompts: list[list[int]], params: dict[str, Any], lora: str | None = None,
                 priorities: list[int] | None = None) -> list[list[Choice]]:
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], _sampling_params(params),
                                    use_tqdm=False, priority=priorities, lora_request=lora)
        return [[_offline_choice(c) for c in out.outputs] for out in outputs]

    def chat(self, messages: list[dict[str, str]], params: dict[str, Any], tools: list[dict[str, Any]]) -> Choice:
        output = self.llm.chat(messages, _sampling_params(params), use_tqdm=False, tools=tools,
                               tool_choice="required")[0].outputs[0]
        return _offline_choice(output)

    def close(self) -> None:
        self.llm.shutdown()


class HttpClient:
    """The OpenAI client against a base URL (the in-process server, or Ray Serve's proxy)."""

    def __init__(self, base_url: str, model: str, server: Server | None = None) -> None:
        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        self.model, self.server = model, server

    def complete(self, prompts: list[list[int]], params: dict[str, Any], lora: str | None = None,
                 priorities: list[int] | None = None) -> list[list[Choice]]:
        def one(index: int) -> list[Choice]:
            body = _openai_params(params)
            if priorities is not None:
                body["extra_body"] = {**body.get("extra_body", {}), "priority": priorities[index]}
            response = self.client.completions.create(model=lora or self.model, prompt=prompts[index], **body)
            return [Choice(c.text, c.finish_reason, c.logprobs.token_logprobs if c.logprobs else None)
                    for c in sorted(response.choices, key=lambda c: c.index)]

        with ThreadPoolExecutor(len(prompts)) as pool:  # at once, so that they share steps
            return list(pool.map(one, range(len(prompts))))

    def chat(self, messages: list[dict[str, str]], params: dict[str, Any], tools: list[dict[str, Any]]) -> Choice:
        response = self.client.chat.completions.create(model=self.model, messages=messages, tools=tools,
                                                       tool_choice="required", **_openai_params(params))
        choice = response.choices[0]
        calls = [{"name": call.function.name, "parameters": json.loads(call.function.arguments)}
                 for call in choice.message.tool_calls or []]
        return Choice(json.dumps(calls), choice.finish_reason)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def http_client(settings: dict[str, Any]) -> HttpClient:
    """The OpenAI app over one engine in this process (`raylm serve --no-ray`)."""
    app, _ = build_engine_app(make_engine_config(**settings))
    server = Server(app)
    wait_until(lambda: server.request("GET", "/health")[0] == 200, "the engine to load", timeout=180)
    return HttpClient(server.base_url, Path(settings["model"]).name, server)


def _sampling_params(params: dict[str, Any]) -> SamplingParams:
    params = dict(params)
    schema = params.pop("json_schema", None)
    if schema is not None:
        params["structured_outputs"] = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if "logit_bias" in params:
        params["logit_bias"] = {int(token): bias for token, bias in params["logit_bias"].items()}
    return SamplingParams(**params)


def _openai_params(params: dict[str, Any]) -> dict[str, Any]:
    body, extra = dict(params), {}
    schema = body.pop("json_schema", None)
    if schema is not None:
        extra["structured_outputs"] = {"json": schema, "disable_any_whitespace": True}
    if "seed" in body and body.get("temperature", 1.0) == 0.0:
        body.pop("seed")
    return {**body, "extra_body": extra} if extra else body


def _offline_choice(output: Any) -> Choice:
    logprobs = None
    if output.logprobs is not None:
        logprobs = [step[token] for step, token in zip(output.logprobs, output.token_ids)]
    return Choice(output.text, output.finish_reason, logprobs)
