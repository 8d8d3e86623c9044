"""Structured output offline (LLM.generate with SamplingParams.structured_outputs) on a random-weight Llama: every
output of a corpus of real-world JSON schemas parses and validates, under both backends; regex, choice, EBNF and
Lark likewise; what no backend enforces is refused naming the field; a grammar that allows the unconstrained argmax
changes no token; logprobs are those of the masked distribution; n > 1, stop strings, min_tokens and a max_tokens
cut inside the grammar all compose."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.structured_output.backend_xgrammar import XgrammarBackend
from raylm.common.sampling_params import FLOAT32_MIN_POSITIVE
from raylm.common.structured_outputs import StructuredOutputsParams
from tests.structured_corpus import CORPUS, UNSUPPORTED, closing_bias, validate_json

PROMPTS = ["The city of", "A list of", "Once upon a time", "Numbers:"]
ENGINE = dict(max_model_len=512, block_size=16, enforce_eager=True)


@pytest.fixture(scope="module")
def llm(llama_path: Path) -> Iterator[LLM]:
    llm = LLM(model=str(llama_path), **ENGINE)
    yield llm
    llm.shutdown()


def json_params(llm: LLM, schema: dict, **extra: object) -> SamplingParams:
    tokenizer = llm.get_tokenizer()
    settings: dict = dict(temperature=0.0, max_tokens=200, logit_bias=closing_bias(tokenizer, tokenizer.eos_token_id))
    return SamplingParams(**{**settings, **extra},
                          structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))


@pytest.mark.parametrize("backend", ["auto", "guidance"])
def test_every_corpus_output_validates(llama_path: Path, backend: str) -> None:
    llm = LLM(model=str(llama_path), structured_outputs_backend=backend, **ENGINE)
    names = list(CORPUS)
    params = [json_params(llm, CORPUS[name]) for name in names]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(names))], params, use_tqdm=False)
    for name, param, output in zip(names, params, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        validate_json(completion.text, CORPUS[name])
        assert param.structured_outputs is not None
        if backend == "auto":  # xgrammar, except where it would not enforce the schema
            expected = "guidance" if name in ("all_of", "min_properties", "multiple_of") else "xgrammar"
            assert param.structured_outputs._backend == expected, name
    llm.shutdown()


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_schemas_are_refused(llm: LLM, name: str) -> None:
    with pytest.raises(ValueError, match=r"^json: ") as err:
        llm.generate(["x"], json_params(llm, UNSUPPORTED[name]), use_tqdm=False)
    assert "guidance" in str(err.value) and "xgrammar" in str(err.value)


def test_xgrammar_backend_refuses_what_it_would_not_enforce(llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), structured_outputs_backend="xgrammar", **ENGINE)
    with pytest.raises(ValueError, match="json: the xgrammar backend does not enforce allOf"):
        llm.generate(["x"], json_params(llm, CORPUS["all_of"]), use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize(("constraint", "check"), [
    (dict(regex=r"[a-z]{2,5}-[0-9]{2,3}"), lambda text: re.fullmatch(r"[a-z]{2,5}-[0-9]{2,3}", text)),
    (dict(choice=["red", "green", "blue sky"]), lambda text: text in ("red", "green", "blue sky")),
    (dict(grammar='root ::= "(" num ("," num)? ")"\nnum ::= [0-9] | [1-9] [0-9]'),
     lambda text: re.fullmatch(r"\((\d|[1-9]\d)(,(\d|[1-9]\d))?\)", text)),
    (dict(grammar="start: \"ab\" DIGITS\nDIGITS: /[0-9]+/"), lambda text: re.fullmatch(r"ab[0-9]+", text)),
    (dict(json_object=True), lambda text: isinstance(validate_json(text, {"type": "object"}), dict)),
])
def test_regex_choice_and_grammars(llm: LLM, constraint: dict, check: object) -> None:
    tokenizer = llm.get_tokenizer()
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=60,
                             logit_bias=closing_bias(tokenizer, tokenizer.eos_token_id),
                             structured_outputs=StructuredOutputsParams(**constraint, disable_any_whitespace=True))
              for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2))]
    for output in llm.generate(PROMPTS[:3], params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and check(completion.text), completion.text  # type: ignore


@pytest.mark.parametrize("constraint", [
    dict(regex="(?<=a)b"), dict(grammar="root ::= undefined_rule"), dict(choice=[]), dict(json="{not json"),
])
def test_uncompilable_constraints_are_refused_naming_the_field(llm: LLM, constraint: dict) -> None:
    kind = next(iter(constraint))
    with pytest.raises(ValueError, match=rf"{kind}"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)


def test_token_exact_where_the_mask_allows_the_argmax(llm: LLM) -> None:
    """A grammar that allows every token the text can hold, and a choice whose first option is the unconstrained text
    itself, leave greedy decoding as it was until the grammar ends; the logprobs are those of the masked
    distribution: the unconstrained ones shifted by the same log mass at each position."""
    prompts = [*PROMPTS, "She said", "In the morning the", "The old river", "A dog and a"]
    plain = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)
    free = llm.generate(prompts, plain, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    anything = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3,
                              structured_outputs=StructuredOutputsParams(regex=r"[\s\S]*"))
    backend = XgrammarBackend(tokenizer, llm.llm_engine.model_info.vocab_size, sorted(llm.llm_engine.eos_token_ids))
    num_equal = 0
    for ours, reference in zip(llm.generate(prompts, anything, use_tqdm=False), free):
        tokens, expected = ours.outputs[0].token_ids, reference.outputs[0].token_ids
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if diverged is not None:  # only where the grammar forbids the argmax (a byte that is not valid UTF-8)
            assert not allowed_after(backend, anything, tokens[:diverged], expected[diverged]), (tokens, expected)
            continue
        num_equal += 1
        assert tokens == expected
        for mine, theirs in zip(ours.outputs[0].logprobs or [], reference.outputs[0].logprobs or []):
            shifts = [mine[t] - theirs[t] for t in mine]
            assert mine.keys() == theirs.keys() and shifts[0] >= 0.0
            assert all(math.isclose(shift, shifts[0], abs_tol=1e-4) for shift in shifts)
    assert num_equal >= 1
    num_choices = 0
    for prompt, reference in zip(prompts, free):
        prefix = reference.outputs[0].token_ids[:6]
        text = tokenizer.decode(prefix)
        if "\ufffd" in text:
            continue  # a partial UTF-8 byte: no string names it
        num_choices += 1
        params = SamplingParams(temperature=0.0, max_tokens=16,
                                structured_outputs=StructuredOutputsParams(choice=[text, "zzz"]))
        completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert completion.text == text and completion.token_ids[:len(prefix)] == prefix
        assert completion.finish_reason == "stop"
    assert num_choices >= 2


def allowed_after(backend: XgrammarBackend, params: SamplingParams, tokens: list[int], token: int) -> bool:
    assert params.structured_outputs is not None
    grammar = backend.compile(params.structured_outputs).new_grammar()
    assert grammar.accept_tokens("check", tokens)
    bitmask = torch.zeros(1, backend.json_token_mask.shape[1], dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def test_logprobs_are_of_the_masked_distribution(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    completion = llm.generate(["Count:"], params, use_tqdm=False)[0].outputs[0]
    tokenizer, eos = llm.get_tokenizer(), llm.llm_engine.eos_token_ids
    assert completion.logprobs
    for position in completion.logprobs:
        finite = {t: lp for t, lp in position.items() if lp > -math.inf}
        assert finite and all(tokenizer.decode([t]).isdigit() or t in eos for t in finite)
        assert max(finite.values()) <= 0.0


def test_max_tokens_inside_the_grammar_is_length(llm: LLM) -> None:
    params = json_params(llm, CORPUS["address"], max_tokens=5)
    completion = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5


def test_n_stop_strings_and_min_tokens_compose(llm: LLM) -> None:
    schema = CORPUS["weather_tool"]
    outputs = llm.generate(["Weather"], json_params(llm, schema, n=3, temperature=1.0, seed=5), use_tqdm=False)
    assert len(outputs[0].outputs) == 3
    for completion in outputs[0].outputs:
        validate_json(completion.text, schema)
    # A stop string inside the JSON ends it there, as for any output.
    stopped = llm.generate(["Weather"], json_params(llm, schema, stop=['"unit"']), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"unit"' and '"unit"' not in stopped.text
    # min_tokens forbids EOS while the grammar can go on; once it can only end, the grammar ends the request.
    choice = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    completion = llm.generate(["Answer"], choice, use_tqdm=False)[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
    nothing = SamplingParams(max_tokens=8, min_tokens=2, structured_outputs=StructuredOutputsParams(choice=[""]))
    completion = llm.generate(["Answer"], nothing, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == [] and completion.finish_reason == "stop"
    digits = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, logit_bias=closing_bias(
        llm.get_tokenizer(), llm.get_tokenizer().eos_token_id),
        structured_outputs=StructuredOutputsParams(regex="[0-9]{1,12}"))
    completion = llm.generate(["Count"], digits, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]+", completion.text) and len(completion.token_ids) >= 6


def test_the_smallest_repetition_penalty_keeps_masked_tokens_out(llm: LLM) -> None:
    """A penalty that is 0 as a float32 turned masked -inf logits into NaN and sampled a forbidden token (found by
    schemathesis: 5e-324); it is refused, and the smallest one the runner can hold keeps to the grammar."""
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324)
    params = [SamplingParams(temperature=temperature, seed=1, max_tokens=8, repetition_penalty=FLOAT32_MIN_POSITIVE,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
              for temperature in (0.0, 1.0)]
    for output in llm.generate(["Answer Answer", "yes no yes"], params, use_tqdm=False):
        assert output.outputs[0].text in ("yes", "no") and output.outputs[0].finish_reason == "stop"
