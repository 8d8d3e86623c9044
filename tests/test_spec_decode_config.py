"""speculative_config as users give it (keyword, YAML, --speculative-config JSON), vLLM's defaults filled in once by
the resolver, impossible combinations refused naming why; and the acceptance figures in the stats line and in
vLLM's Prometheus metrics."""
from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.spec_decode import SpecDecodingStats
from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.cluster.engine.stats import IterationStats, LoggingStatLogger, SchedulerStats
from raylm.cluster.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.cluster.tools.draft_checkpoint import make_draft_checkpoint
from raylm.configs import add_engine_args, engine_args_from, make_engine_config


def resolve(model: Path, spec: dict[str, Any], **settings: Any) -> Any:
    return resolve_engine_config(make_engine_config(model=str(model), device="cpu", max_model_len=128,
                                                    speculative_config=spec, **settings)).speculative_config


def test_ngram_defaults_are_vllms(llama_path: Path) -> None:
    def lookup(**given: int) -> tuple[int | None, int | None]:
        spec = resolve(llama_path, {"method": "ngram", "num_speculative_tokens": 3, **given})
        return spec.prompt_lookup_min, spec.prompt_lookup_max

    assert lookup() == (5, 5)
    assert lookup(prompt_lookup_max=3) == (3, 3)
    assert lookup(prompt_lookup_min=2) == (2, 2)
    assert lookup(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4)


def test_draft_model_resolves_its_checkpoint(llama_path: Path, tmp_path: Path) -> None:
    draft = make_draft_checkpoint(llama_path, tmp_path / "draft", 1)
    config = resolve_engine_config(make_engine_config(
        model=str(llama_path), device="cpu", max_model_len=128,
        speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)}))
    assert config.speculative_config.draft_tensor_parallel_size == 1
    assert config.resolved.draft_model_info.num_hidden_layers == 1


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vocab") / "llama", arch="llama", num_layers=1, vocab_size=300)


@pytest.mark.parametrize(("spec", "settings", "message"), [
    ({"method": "ngram", "model": "/x"}, {}, "speculative_config.model is for method 'draft_model'"),
    ({"method": "ngram", "draft_tensor_parallel_size": 1}, {}, "draft_tensor_parallel_size is for method"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {}, r"prompt_lookup_min \(4\) must be <="),
    ({"method": "ngram"}, {"pipeline_parallel_size": 2}, "not supported with pipeline_parallel_size > 1"),
    ({"method": "ngram", "num_speculative_tokens": 8}, {"max_num_batched_tokens": 8},
     r"num_speculative_tokens \(8\) \+ 1 must be <= max_num_batched_tokens"),
    ({"method": "draft_model"}, {}, "method 'draft_model' needs the draft checkpoint"),
    ({"method": "draft_model", "model": "DRAFT", "prompt_lookup_max": 3}, {},
     "prompt_lookup_max is for method 'ngram'"),
    ({"method": "draft_model", "model": "DRAFT", "draft_tensor_parallel_size": 1},
     {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
     r"draft_tensor_parallel_size \(1\) must equal tensor_parallel_size \(2\)"),
    ({"method": "draft_model", "model": "OTHER_VOCAB"}, {}, r"vocab_size \(300\) differs from the target's \(512\)"),
])
def test_impossible_combinations_are_refused(llama_path: Path, other_vocab: Path, tmp_path: Path,
                                             spec: dict[str, Any], settings: dict[str, Any], message: str) -> None:
    draft = make_draft_checkpoint(llama_path, tmp_path / "draft", 1)
    spec = {"num_speculative_tokens": 3, **spec}
    spec = {key: {"DRAFT": str(draft), "OTHER_VOCAB": str(other_vocab)}.get(value, value) if key == "model" else value
            for key, value in spec.items()}
    with pytest.raises(ValueError, match=message):
        resolve(llama_path, spec, **settings)


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "speculative_config.lookahead"),
    ("{not json", "speculative_config: not valid JSON"),
    (["ngram"], "speculative_config: expected a mapping"),
])
def test_bad_values_name_the_field(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine_config(speculative_config=spec)


def test_yaml_keyword_and_cli_give_the_same_section(tmp_path: Path) -> None:
    yaml_file = tmp_path / "spec.yaml"
    yaml_file.write_text("max_num_seqs: 4\nspeculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    from_yaml = make_engine_config(yaml_file).speculative_config
    from_keyword = make_engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    from_cli = make_engine_config(**engine_args_from(args)).speculative_config
    assert from_yaml == from_keyword.speculative_config == from_cli
    assert from_yaml is not None and from_yaml.num_speculative_tokens == 3
    assert make_engine_config().speculative_config is None


def test_stats_line_and_prometheus_report_acceptance() -> None:
    before = SpecDecodingStats.new(3)
    after = before.copy()
    for num_accepted in (3, 1, 0, 2):
        after.observe(3, num_accepted)
    line = LoggingStatLogger.format(0, SchedulerStats(num_running_reqs=1, spec_decoding=after),
                                    SchedulerStats(spec_decoding=before), 1.0)
    assert line is not None and line.endswith("Mean acceptance length: 2.50, Draft acceptance rate: 50.0%")

    metrics = PrometheusStatLogger("tiny")
    metrics.record(0, SchedulerStats(spec_decoding=before), IterationStats())
    metrics.record(0, SchedulerStats(spec_decoding=after), IterationStats())
    text = metrics.exposition().decode()

    def value(name: str, extra: str = "") -> float:
        match = re.search(rf'^{name}_total{{engine="0",model_name="tiny"{extra}}} (\S+)$', text, re.M)
        assert match is not None, (name, text)
        return float(match.group(1))

    assert value("vllm:spec_decode_num_drafts") == 4
    assert value("vllm:spec_decode_num_draft_tokens") == 12
    assert value("vllm:spec_decode_num_accepted_tokens") == 6
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos", f',position="{p}"') for p in range(3)] == [3, 2, 1]


def test_engine_logs_the_mean_acceptance_length(llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="raylm.stats")
    llm = LLM(model=str(llama_path), max_model_len=256, log_stats_interval_s=0.005,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompt = list(range(20, 40)) * 3
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.engine_core.engine_stats()[0].spec_decoding
    llm.shutdown()
    assert stats is not None and stats.num_drafts > 0
    lines = [record.getMessage() for record in caplog.records if record.name == "raylm.stats"]
    assert any(re.search(r"Mean acceptance length: [\d.]+, Draft acceptance rate: [\d.]+%$", line) for line in lines)
