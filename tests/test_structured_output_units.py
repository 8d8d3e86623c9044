"""The pieces of structured output on their own: the runner's bitmask on the logits (rows by request id, a model
vocabulary wider than the bitmask), requests whose grammar is compiling wait without holding back others (and one
whose grammar fails is finished, not lost), and which backend each constraint goes to."""
from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from raylm.cluster.core.request import Request, RequestStatus
from raylm.cluster.core.scheduler import Scheduler
from raylm.cluster.core.structured_output import StructuredOutputManager, validate_structured_outputs
from raylm.cluster.core.structured_output.backend_xgrammar import XgrammarBackend
from raylm.cluster.core.structured_output.request import StructuredOutputRequest
from raylm.cluster.engine.environment import gather_environment
from raylm.common.outputs import GrammarOutput, ModelRunnerOutput
from raylm.common.sampling_params import SamplingParams
from raylm.common.structured_outputs import StructuredOutputsParams
from raylm.configs.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from raylm.configs.resolve_sections import structured_outputs_backends
from raylm.configs.structured_outputs_config import StructuredOutputsConfig
from raylm.runner.structured_output import apply_grammar_bitmask
from tests.runner_steps import resolved_config


def packed(allowed: list[list[int]], width: int) -> np.ndarray:
    rows = np.zeros((len(allowed), width), dtype=np.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            rows[row, token // 32] |= 1 << (token % 32)
    return rows.astype(np.uint32).view(np.int32)


def test_bitmask_rows_follow_request_ids_and_pad_the_vocabulary() -> None:
    logits = torch.randn(3, 70)  # 70 > 64: the last 6 columns have no bits
    original = logits.clone()
    output = GrammarOutput(["c", "a", "gone"], packed([[0, 33], [5, 31, 63], [1]], 2))
    apply_grammar_bitmask(logits, output, ["a", "b", "c"])
    assert torch.equal(logits[1], original[1])  # b is not constrained
    for row, tokens in ((0, [5, 31, 63]), (2, [0, 33])):
        finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert finite == tokens and torch.equal(logits[row, tokens], original[row, tokens])
    sign_bits = torch.zeros(1, 64)
    apply_grammar_bitmask(sign_bits, GrammarOutput(["x"], packed([[31, 63]], 2)), ["x"])
    assert torch.isfinite(sign_bits[0]).nonzero().flatten().tolist() == [31, 63]  # each word's sign bit: its last token


def test_bitmask_rows_with_drafts_cover_each_requests_logits_rows() -> None:
    # Logits rows: a (2 drafts + bonus), b (bonus), c (1 draft + bonus); c is not constrained.
    logits = torch.zeros(6, 64)
    output = GrammarOutput(["b", "a"], packed([[9], [1], [2], [3]], 2))
    apply_grammar_bitmask(logits, output, ["a", "b", "c"], [2, 0, 1])
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite[:4] == [[1], [2], [3], [9]] and finite[4] == finite[5] == list(range(64))


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), CacheConfig(), 128, 64, 16)


def constrained(request_id: str, future: Future) -> Request:
    params = StructuredOutputsParams(regex="[a-z]+")
    request = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4, seed=0, structured_outputs=params))
    request.structured_output_request = StructuredOutputRequest(params, future)
    return request


def test_compiling_grammars_hold_back_no_one(llama_path: Path) -> None:
    scheduler = make_scheduler()
    compiling, failing = Future(), Future()
    scheduler.add_request(constrained("slow", compiling))
    scheduler.add_request(constrained("bad", failing))
    scheduler.add_request(Request("free", [4, 5], SamplingParams(max_tokens=4, seed=0)))
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["free"]
    assert scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_FSM and scheduler.num_waiting == 2

    backend = XgrammarBackend(AutoTokenizer.from_pretrained(llama_path), 512, [1])
    compiling.set_result(backend.compile(StructuredOutputsParams(regex="[a-z]+")))
    failing.set_exception(RuntimeError("no"))
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["slow"] and "bad" in output.finished_req_ids
    outputs = scheduler.update_from_output(output, ModelRunnerOutput(["slow"], [[]]))
    # The server failed it: an error, not an abort (which is for a client that went away).
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "error")]
    assert "failed to compile" in str(outputs[0].stop_reason) and "bad" not in scheduler.requests


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_sampled_token_the_grammar_forbids_ends_the_request_as_an_error(llama_path: Path, backend: str) -> None:
    """The bitmask makes it impossible, so a forbidden sample means something upstream went wrong: the request ends
    with an error naming the token and the constraint, and the token is not output (vLLM logs it and goes on)."""
    config = resolved_config(model=str(llama_path), structured_outputs_backend=backend, max_num_seqs=4)
    manager = StructuredOutputManager(config)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), CacheConfig(), 128, 64, 16,
                          structured_output_manager=manager)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, seed=0,
                                                     structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    manager.grammar_init(request)
    assert request.structured_output_request is not None
    request.structured_output_request.compiled.result()
    scheduler.add_request(request)
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    good, bad = tokenizer.encode("abc", add_special_tokens=False)[0], tokenizer.encode("7", add_special_tokens=False)[0]
    for token, allowed in ((good, True), (bad, False)):
        output = scheduler.schedule()
        grammar_output = manager.grammar_bitmask(scheduler.requests, ["r"], {})
        assert grammar_output is not None
        row = grammar_output.grammar_bitmask[0]
        assert bool((int(row[token // 32]) >> (token % 32)) & 1) == allowed  # a real matcher's mask
        outputs = scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[token]]))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("r", [], "error")]
    message = str(outputs[0].stop_reason)
    assert message.startswith("regex: the sampled token") and f"token {bad} ('7')" in message
    assert "[a-z]+" in message and backend in message
    assert request.output_token_ids == [good] and "r" not in scheduler.requests
    manager.shutdown()


@pytest.mark.parametrize(("params", "backend", "expected"), [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}), "auto", "xgrammar"),
    (StructuredOutputsParams(json={"type": "integer", "multipleOf": 3}), "auto", "guidance"),
    (StructuredOutputsParams(grammar='start: "a" | "b"'), "auto", "guidance"),  # Lark: not xgrammar's EBNF
    (StructuredOutputsParams(grammar='root ::= "a" | "b"'), "guidance", "guidance"),  # EBNF converted to Lark
    (StructuredOutputsParams(structural_tag='{"structures": [{"begin": "<f>", "schema": {"type": "integer"}, '
                                           '"end": "</f>"}], "triggers": ["<f>"]}'), "auto", "xgrammar"),
])
def test_backend_choice(params: StructuredOutputsParams, backend: str, expected: str) -> None:
    assert validate_structured_outputs(params, backends(backend)) == expected


def backends(setting: str) -> tuple[str, ...]:
    here = gather_environment(EngineConfig(), kernels=False)  # the packages installed in this process
    return structured_outputs_backends(StructuredOutputsConfig(structured_outputs_backend=setting), here)


def test_the_resolver_decides_the_backend_list() -> None:
    assert backends("auto") == ("xgrammar", "guidance") and backends("guidance") == ("guidance",)
    with pytest.raises(ValueError, match="enforces no output constraints .its config was resolved without grammar"):
        validate_structured_outputs(StructuredOutputsParams(regex="a"), ())


def test_a_backend_that_cannot_is_named() -> None:
    with pytest.raises(ValueError, match="structural_tag: the guidance backend does not support structural tags"):
        validate_structured_outputs(StructuredOutputsParams(structural_tag='{"structures": [], "triggers": []}'),
                                    backends("guidance"))
    with pytest.raises(ValueError, match="xgrammar backend does not enforce multipleOf"):
        validate_structured_outputs(StructuredOutputsParams(json={"type": "integer", "multipleOf": 3}),
                                    backends("xgrammar"))
