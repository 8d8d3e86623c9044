"""Speculative decoding with structured output (issue #25): constrained greedy requests (a JSON schema, a regex, a
choice) give exactly the tokens they give without drafts, with ngram drafts, a draft model, drafts the grammar
mostly rejects and async scheduling (where constrained requests verify no drafts); the bitmask rows of a request
with drafts are those of its matcher advanced draft by draft, and the matcher is back where it was afterwards."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.request import Request
from raylm.cluster.core.structured_output import StructuredOutputManager
from raylm.cluster.tools.draft_checkpoint import make_draft_checkpoint
from raylm.common.outputs import GrammarOutput
from raylm.common.structured_outputs import StructuredOutputsParams
from tests.runner_steps import resolved_config
from tests.structured_corpus import CORPUS, closing_bias, validate_json

ENGINE = dict(max_model_len=512, block_size=16, enforce_eager=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REGEX = r"[a-z]{2,5}-[0-9]{2,3}"
DIGITS = r"[0-9]{4,30}"
CHOICES = ["red", "green", "blue sky"]
# (prompt, constraint, check of the text): prompts that hold text like the output, so that ngram drafts are often
# grammar-valid, and one (digits) where the lookup mostly proposes the letters after each digit, which it rejects.
CASES: list[tuple[str, dict[str, Any], Any]] = [
    ('{"locality": "Paris", "region": "IDF", "country_name": "France", "postal_code": "75001"} again: ',
     dict(json=CORPUS["address"]), lambda text: validate_json(text, CORPUS["address"])),
    ('{"location": "Boston, MA", "unit": "celsius"} {"location": "Boston, MA", "unit": ',
     dict(json=CORPUS["weather_tool"]), lambda text: validate_json(text, CORPUS["weather_tool"])),
    ("abc-12 abc-12 abc-", dict(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
    ("1a 2b 3c 4d 1a 2b 3c 4d 1a 2b 3c 4d 1", dict(regex=DIGITS), lambda text: re.fullmatch(DIGITS, text)),
    ("red green blue sky red green blue", dict(choice=CHOICES), lambda text: text in CHOICES),
]


@pytest.fixture(scope="module")
def draft_path(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target itself as the draft: it proposes the unconstrained argmax, which the grammar often refuses and
    the constrained target accepts where the two agree (a one-layer draft of a random model agrees nowhere)."""
    return make_draft_checkpoint(llama_path, tmp_path_factory.mktemp("draft") / "copy", 2)


@pytest.fixture(scope="module")
def tokenizer(llama_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_path)


def constrained_params(tokenizer: Any) -> list[SamplingParams]:
    bias = closing_bias(tokenizer, tokenizer.eos_token_id)
    return [SamplingParams(temperature=0.0, max_tokens=120, logit_bias=bias,
                           structured_outputs=StructuredOutputsParams(**constraint, disable_any_whitespace=True))
            for _, constraint, _ in CASES]


def run(path: Path, tokenizer: Any, **settings: Any) -> tuple[list[list[int]], LLM]:
    """Every case, and an unconstrained request beside them; the constrained outputs' tokens (each checked)."""
    llm = LLM(model=str(path), **ENGINE, **settings)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([prompt for prompt, _, _ in CASES] + [CASES[0][0]],
                           [*constrained_params(tokenizer), free], use_tqdm=False)
    tokens = []
    for (_, constraint, check), output in zip(CASES, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and check(completion.text), (constraint, completion.text)
        tokens.append(list(completion.token_ids))
    return tokens, llm


@pytest.fixture(scope="module")
def reference(llama_path: Path, tokenizer: Any) -> list[list[int]]:
    tokens, llm = run(llama_path, tokenizer)
    llm.shutdown()
    return tokens


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the proposals validate_tokens cut (a draft the grammar rejects) and the constrained requests' bitmasks
    with draft rows."""
    counted = {"cut": 0, "draft_rows": 0}
    validate, bitmask = StructuredOutputManager.validate_tokens, StructuredOutputManager.grammar_bitmask

    def counting_validate(self: StructuredOutputManager, request: Request, tokens: list[int]) -> list[int]:
        valid = validate(self, request, tokens)
        counted["cut"] += len(valid) < len(tokens)
        return valid

    def counting_bitmask(self: StructuredOutputManager, requests: dict[str, Request], req_ids: list[str],
                         spec_tokens: dict[str, list[int]]) -> GrammarOutput | None:
        counted["draft_rows"] += sum(bool(spec_tokens.get(req_id)) for req_id in req_ids)
        return bitmask(self, requests, req_ids, spec_tokens)

    monkeypatch.setattr(StructuredOutputManager, "validate_tokens", counting_validate)
    monkeypatch.setattr(StructuredOutputManager, "grammar_bitmask", counting_bitmask)
    yield counted


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_greedy_is_unchanged_by_drafts(llama_path: Path, draft_path: Path, tokenizer: Any,
                                                   reference: list[list[int]], counts: dict[str, int],
                                                   method: str) -> None:
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3,
                                            "model": str(draft_path)}
    tokens, llm = run(llama_path, tokenizer, speculative_config=spec)
    stats = llm.llm_engine.engine_core.scheduler.drafts.stats
    llm.shutdown()
    assert tokens == reference
    assert stats.num_accepted_tokens > 0 and counts["cut"] > 0 and counts["draft_rows"] > 0


def test_constrained_requests_verify_no_drafts_under_async_scheduling(llama_path: Path, tokenizer: Any,
                                                                      reference: list[list[int]],
                                                                      counts: dict[str, int]) -> None:
    tokens, llm = run(llama_path, tokenizer, speculative_config=NGRAM, async_scheduling=True)
    stats = llm.llm_engine.engine_core.scheduler.drafts.stats
    llm.shutdown()
    assert tokens == reference
    assert counts["draft_rows"] == 0 and stats.num_drafts > 0  # the unconstrained request still speculates


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_draft_rows_are_the_matchers_token_by_token_and_it_rolls_back(llama_path: Path, tokenizer: Any,
                                                                      backend: str) -> None:
    config = resolved_config(model=str(llama_path), speculative_config=NGRAM, structured_outputs_backend=backend,
                             max_num_seqs=2)
    manager = StructuredOutputManager(config)
    params = StructuredOutputsParams(regex=REGEX)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=16, seed=0, structured_outputs=params))
    manager.grammar_init(request)
    structured = request.structured_output_request
    assert structured is not None and structured.compiled.result() is not None and structured.is_ready()
    good = tokenizer.encode("ab-12", add_special_tokens=False)  # 1 accepted token, then the drafts
    bad = tokenizer.encode("!", add_special_tokens=False)
    assert len(good) > 2 and manager.validate_tokens(request, good + bad + good) == good

    # A reference matcher, advanced draft by draft (after one accepted token, to start mid-grammar).
    first, drafts = good[0], good[1:]
    assert manager.accept(request, first) and manager.advance(request, first) is False
    reference = structured.compiled.result().new_grammar()
    assert reference.accept_tokens("ref", [first])
    expected = torch.zeros(len(drafts) + 1, manager.bitmask.shape[1], dtype=torch.int32)
    for i, token in enumerate([*drafts, None]):
        reference.fill_bitmask(expected, i)
        if token is not None:
            assert reference.accept_tokens("ref", [token])
    output = manager.grammar_bitmask({"r": request}, ["r"], {"r": drafts})
    assert output is not None and output.structured_output_request_ids == ["r"]
    assert torch.equal(torch.from_numpy(output.grammar_bitmask), expected)

    # Rolled back: the matcher fills the first row again, and takes the drafts as accepted tokens.
    after = torch.zeros(1, manager.bitmask.shape[1], dtype=torch.int32)
    structured.grammar.fill_bitmask(after, 0)
    assert torch.equal(after[0], expected[0])
    assert structured.grammar.accept_tokens("r", drafts)
    manager.shutdown()
