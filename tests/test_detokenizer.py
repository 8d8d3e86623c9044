"""Incremental detokenization and output processing against a small byte-level BPE trained here."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.engine.detokenizer import IncrementalDetokenizer
from raylm.cluster.engine.output_processor import OutputProcessor
from raylm.cluster.engine.outputs import RequestOutput
from raylm.common.outputs import LogprobsLists
from raylm.common.sampling_params import SamplingParams

_WORDS = ["hello", "world", "café", "naïve", "résumé", "中文", "日本語", "😀", "🚀", "über", "crème", "data", "END"]
_TEXTS = ["hello world", "café 中文 😀 naïve", "🚀🚀 日本語 résumé crème", "中文😀über data 🚀 END hello"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10))) for _ in range(300)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # A vocabulary this small leaves most multi-byte characters split over several tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(sentences, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_multibyte_characters_are_split_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _encode(tokenizer, "中文 😀")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", _TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_matches_full_decode(tokenizer: PreTrainedTokenizerFast, text: str, chunk: int) -> None:
    prompt_ids = _encode(tokenizer, "data 中")
    output_ids = _encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    for end in range(chunk, len(output_ids) + chunk, chunk):
        assert detokenizer.update(output_ids[end - chunk:end]) is None
        full = tokenizer.decode(output_ids[:end], skip_special_tokens=True)
        assert "\ufffd" not in detokenizer.output_text
        # A token ending in an incomplete character is held back whole, with any complete characters in it.
        if full.endswith("\ufffd"):
            assert full.startswith(detokenizer.output_text)
        else:
            assert detokenizer.output_text == full
    assert detokenizer.output_text == text
    assert detokenizer.output_token_ids == output_ids


def test_decode_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    window_sizes: list[int] = []
    decode = tokenizer.decode

    class CountingTokenizer:
        def decode(self, token_ids: list[int], **kwargs: object) -> str:
            window_sizes.append(len(token_ids))
            return decode(token_ids, **kwargs)

    output_ids = _encode(tokenizer, " ".join(_TEXTS * 20))
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), [])  # type: ignore[arg-type]
    detokenizer.update(output_ids)
    assert detokenizer.output_text == tokenizer.decode(output_ids)
    assert max(window_sizes) <= 8


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    output_ids = _encode(tokenizer, "hello world data")
    stop = "o wor"
    assert not any(stop in tokenizer.decode([i]) for i in output_ids)
    stop_token = next(n for n in range(1, len(output_ids) + 1) if stop in tokenizer.decode(output_ids[:n]))

    for include, expected in [(False, "hell"), (True, "hello wor")]:
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["data", stop], include_stop_str_in_output=include)
        results = [detokenizer.update([i]) for i in output_ids[:stop_token]]
        assert results == [None] * (stop_token - 1) + [stop]
        assert detokenizer.output_text == expected

        # Fed all at once, the tokens after the one completing the stop string are dropped.
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[stop], include_stop_str_in_output=include)
        assert detokenizer.update(output_ids) == stop
        assert detokenizer.output_text == expected
        assert detokenizer.output_token_ids == output_ids[:stop_token]


def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["world", "lo"])
    assert detokenizer.update(_encode(tokenizer, "hello world")) == "lo"
    assert detokenizer.output_text == "hel"


@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_shows_part_of_a_stop_string(tokenizer: PreTrainedTokenizerFast, include: bool) -> None:
    text = "data ENhello 中文 EN😀 café END naïve"
    output_ids = _encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["END"], include_stop_str_in_output=include)
    final = "data ENhello 中文 EN😀 café " + ("END" if include else "")
    streamed = ""
    for token_id in output_ids:
        stop_str = detokenizer.update([token_id])
        finished = stop_str is not None
        streamed += detokenizer.get_next_output_text(finished, delta=True)
        assert final.startswith(streamed)
        assert final.startswith(detokenizer.get_next_output_text(finished, delta=False))
        if finished:
            break
    assert streamed == detokenizer.output_text == final


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    output_ids = _encode(tokenizer, "hello") + [tokenizer.eos_token_id] + _encode(tokenizer, " café")
    for skip, expected in [(True, "hello café"), (False, "hello</s> café")]:
        detokenizer = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id], skip_special_tokens=skip)
        for token_id in output_ids:
            detokenizer.update([token_id])
        assert detokenizer.output_text == expected == tokenizer.decode(output_ids, skip_special_tokens=skip)


def _logprobs(token_ids: list[int]) -> LogprobsLists:
    """The sampled token first, then a top-1 that is always token 0."""
    return LogprobsLists(
        token_ids=[[t, 0] for t in token_ids],
        logprobs=[[-float(n), -0.5] for n in range(len(token_ids))],
        ranks=[2] * len(token_ids),
    )


def _only(outputs: list[RequestOutput]) -> RequestOutput:
    assert len(outputs) == 1
    return outputs[0]


def test_output_processor_n2_with_stop_and_logprobs(tokenizer: PreTrainedTokenizerFast) -> None:
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, stop=["END"], logprobs=1)
    prompt_ids = _encode(tokenizer, "hello")
    for index in range(2):
        processor.add_request(f"{index}_req", "hello", prompt_ids, params, parent_id="req", index=index)

    ids0 = _encode(tokenizer, " world END data")
    ids1 = _encode(tokenizer, " café 中文")
    stop_token = next(n for n in range(1, len(ids0) + 1) if "END" in tokenizer.decode(ids0[:n]))
    step = processor.process_outputs([
        EngineCoreOutput("0_req", ids0, new_logprobs=_logprobs(ids0), num_cached_tokens=1),
        EngineCoreOutput("1_req", ids1[:2], new_logprobs=_logprobs(ids1[:2])),
    ])
    assert step.reqs_to_abort == ["0_req"]
    output = _only(step.request_outputs)
    assert output.request_id == "req" and not output.finished and output.num_cached_tokens == 1
    first, second = output.outputs
    assert (first.index, first.text, first.finish_reason, first.stop_reason) == (0, " world ", "stop", "END")
    assert first.token_ids == ids0[:stop_token]
    assert first.logprobs == [{t: -float(n), 0: -0.5} for n, t in enumerate(ids0[:stop_token])]
    assert second.index == 1 and second.token_ids == ids1[:2] and not second.finished()

    # The stopped child's late output (the step the abort raced with) is ignored.
    step = processor.process_outputs([
        EngineCoreOutput("0_req", ids0[:1], new_logprobs=_logprobs(ids0[:1])),
        EngineCoreOutput("1_req", ids1[2:], finish_reason="length", new_logprobs=_logprobs(ids1[2:])),
    ])
    output = _only(step.request_outputs)
    assert output.finished and step.reqs_to_abort == []
    assert [c.text for c in output.outputs] == [" world ", " café 中文"]
    assert output.outputs[1].finish_reason == "length" and len(output.outputs[1].logprobs or []) == len(ids1)
    assert not processor.has_unfinished_requests()


def test_output_processor_delta_mode(tokenizer: PreTrainedTokenizerFast) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [], SamplingParams(stop=["END"]), output_kind="delta")
    output_ids = _encode(tokenizer, "中文 😀 café END data")
    texts, token_ids = [], []
    finished = False
    for token_id in output_ids:
        step = processor.process_outputs([EngineCoreOutput("r", [token_id])])
        output = _only(step.request_outputs)
        (completion,) = output.outputs
        texts.append(completion.text)
        token_ids += completion.token_ids
        assert completion.logprobs is None
        if output.finished:
            finished = True
            assert completion.stop_reason == "END" and step.reqs_to_abort == ["r"]
            break
    assert finished and "".join(texts) == "中文 😀 café "
    assert tokenizer.decode(token_ids).startswith("中文 😀 café END")


def test_output_processor_stop_token_and_abort(tokenizer: PreTrainedTokenizerFast) -> None:
    processor = OutputProcessor(tokenizer)
    eos = tokenizer.eos_token_id
    processor.add_request("single", "p", [], SamplingParams())
    step = processor.process_outputs([EngineCoreOutput("single", [*_encode(tokenizer, "hi"), eos], "stop", eos)])
    (completion,) = _only(step.request_outputs).outputs
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("hi", "stop", eos)
    assert step.reqs_to_abort == []

    params = SamplingParams(n=3)
    for index in range(3):
        processor.add_request(f"{index}_par", None, [], params, parent_id="par", index=index)
    processor.add_request("other", None, [], SamplingParams())
    processor.process_outputs([EngineCoreOutput("1_par", _encode(tokenizer, "x"), "length")])
    assert processor.abort_request("par") == ["0_par", "2_par"]
    assert processor.abort_request("par") == []
    assert processor.process_outputs([EngineCoreOutput("0_par", _encode(tokenizer, "x"))]).request_outputs == []
    assert processor.has_unfinished_requests()
    assert processor.abort_request("other") == ["other"]
    assert not processor.has_unfinished_requests()


def test_invalid_utf8_is_emitted_after_a_bounded_wait(tokenizer: PreTrainedTokenizerFast) -> None:
    lead_byte = tokenizer.convert_tokens_to_ids("ä")  # byte 0xE4 alone: a 3-byte character never completed
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    detokenizer.update([lead_byte] * 30)
    assert set(detokenizer.output_text) == {"\ufffd"}
    assert detokenizer.num_output_tokens - detokenizer.prefix_offset <= 18


@pytest.mark.parametrize("output_kind", ["cumulative", "delta"])
def test_output_processor_prompt_logprobs(tokenizer: PreTrainedTokenizerFast, output_kind: str) -> None:
    processor = OutputProcessor(tokenizer)
    prompt_ids = _encode(tokenizer, "hello world")
    for index in range(2):
        processor.add_request(f"{index}_p", None, prompt_ids, SamplingParams(n=2, prompt_logprobs=1), parent_id="p",
                              index=index, output_kind=output_kind)
    scored = prompt_ids[1:]
    prompt_logprobs = LogprobsLists([[t, 0] for t in scored], [[-1.0, -0.5] for _ in scored], [2] * len(scored))
    expected = [None, *({t: -1.0, 0: -0.5} for t in scored)]
    step = processor.process_outputs([EngineCoreOutput("1_p", [5]),
                                      EngineCoreOutput("0_p", [6], new_prompt_logprobs=prompt_logprobs)])
    assert _only(step.request_outputs).prompt_logprobs == expected
    step = processor.process_outputs([EngineCoreOutput("0_p", [7], "length"), EngineCoreOutput("1_p", [8], "length")])
    # Cumulative outputs repeat them; deltas carry them once.
    assert _only(step.request_outputs).prompt_logprobs == (expected if output_kind == "cumulative" else None)
