"""scripts/gpu_check.py runs only on a GPU, rarely: its sections and measurements run here on CPU on tiny inputs, so
an API change breaks a test instead of the next GPU run."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylm.runner.cuda_graph import CUDAGraphRunner
from scripts import gpu_check, gpu_measure, gpu_proof
from scripts.bench_common import vocab_size

REPO = Path(__file__).resolve().parents[1]


def test_decode_ms_times_steps_and_leaves_the_engine_idle(llama_path: Path) -> None:
    llm = gpu_measure.make_llm(llama_path, max_model_len=128)
    try:
        assert gpu_measure.decode_ms(llm, 3, steps=4, warmup=2) > 0
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        gpu_measure.close(llm)


def test_backends_section_compares_greedy_tokens(llama_path: Path, moe_checkpoints: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "installed", lambda package: False)  # no triton or flash-attn run on CPU
    check = gpu_check.GpuCheck(llama_path, moe_checkpoints["mixtral"], llama_path.parent / "unused")
    gpu_check.run_section(check, "1 backends", gpu_check.check_backends)
    # On CPU nothing is captured: the "graphs" rows compare tokens but prove nothing about graphs, and say so.
    assert [(r["metric"], r["ok"]) for r in check.rows] == [
        ("triton", None), ("flash_attn", None), ("torch graphs vs torch eager, fp32", None),
        ("mixtral graphs vs eager, bf16 (grouped matmul)", None)]
    assert check.rows[-1]["value"] == "8/8 prompts identical, 0 forwards replayed a graph"


def test_16_bit_runs_may_diverge_at_a_near_tie_only() -> None:
    ref = [([5, 6, 7], [{5: -0.1}, {6: -0.50, 9: -0.51}, {7: -0.2}])]
    near_tie = [([5, 9, 3], [{5: -0.1}, {9: -0.50, 6: -0.51}, {3: -0.2}])]  # 9 for 6, 0.01 apart on both sides
    far = [([5, 9, 3], [{5: -0.1}, {9: -0.40, 6: -0.51}, {3: -0.2}])]  # 9 for 6, but 0.11 apart in this run
    assert gpu_measure.compare_greedy(ref, ref, exact=True) == ("1/1 prompts identical", True)
    assert gpu_measure.compare_greedy(near_tie, ref, exact=True) == ("0/1 prompts identical, 1 diverged at a near-tie",
                                                                     False)
    assert gpu_measure.compare_greedy(near_tie, ref, exact=False)[1] is True
    assert gpu_measure.compare_greedy(far, ref, exact=False) == ("0/1 prompts identical", False)


def test_a_graphs_row_fails_when_no_graph_replayed(llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CUDA is present a "graphs" row needs replays: tokens equal to eager are not enough (both may be eager)."""
    monkeypatch.setattr(gpu_check, "installed", lambda package: False)
    monkeypatch.setattr(gpu_check, "graphs_are_captured", lambda: True)  # as on a GPU, where the run stayed eager
    check = gpu_check.GpuCheck(llama_path, llama_path, llama_path.parent / "unused")
    gpu_check.run_section(check, "1 backends", gpu_check.check_backends)
    graphs_rows = [r for r in check.rows if "graphs" in r["metric"]]
    assert graphs_rows and all(r["ok"] is False for r in graphs_rows), graphs_rows


def test_random_qwen_runs_in_raylm_and_transformers(llama_path: Path, tmp_path: Path) -> None:
    """Section 3's checkpoint (shrunk) loads in both engines with the tiny tokenizer, whose vocabulary is smaller than
    the model's (as Qwen2's 151,936 rows beside the tiny 2,048 tokens); both generate every token."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2 * vocab_size(llama_path))
    qwen = gpu_measure.build_random_qwen(tmp_path / "qwen", llama_path, device="cpu", **shape)
    assert (qwen / "tokenizer.json").is_file()
    batch = gpu_measure.prompts(3, 4, 12, vocab_size(qwen), seed=1)
    tokens_per_s, weight_bytes = gpu_measure.transformers_generate(qwen, batch, 5, device="cpu")
    assert tokens_per_s > 0
    assert weight_bytes == 2 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(qwen).parameters())
    outputs = gpu_measure.greedy_tokens(qwen, batch, dtype="bfloat16", max_model_len=64)
    assert [(len(tokens), len(tops)) for tokens, tops in outputs] == [(gpu_measure.GREEDY.max_tokens,) * 2] * 3


class CpuGraphs(CUDAGraphRunner):
    """CUDAGraphRunner without CUDA: 'capture' keeps the body, 'replay' runs it; the counts are the real class's."""

    def capture(self, sizes: list[int], body: Callable[[int], torch.Tensor]) -> None:
        self.body = body
        for n in sizes:
            self.graphs[n] = None  # type: ignore[assignment]  # nothing to replay: replay() runs the body
            self.num_captures[n] += 1

    def replay(self, num_tokens: int) -> torch.Tensor:
        self.num_replays[num_tokens] += 1
        return self.body(num_tokens)


def test_graph_proof_passes_replayed_steps_and_fails_eager_ones(llama_path: Path) -> None:
    """What section 2 proves, on the runner's real replay path: every timed step's graph key says it replayed the
    graph of its padded size, captured once; with no graph captured the same steps run eagerly, and both the step
    rows and the capture row fail."""
    llm = gpu_measure.make_llm(llama_path, max_model_len=128, attention_backend="torch",
                               cudagraph_capture_sizes=[1, 2, 4])
    try:
        runner = llm.llm_engine.engine_core.executor.collective_rpc(lambda worker: worker.model_runner)[0]
        graphs = CpuGraphs()
        graphs.capture([1, 2, 4], lambda n: runner.graphs.forward(runner.model, n))
        runner.graphs.runner = graphs
        value, ok = gpu_proof.check_replays(gpu_proof.timed_decode(llm, 3, steps=4, warmup=2), graphs=True)
        assert ok and value.endswith("4/4 steps replayed (FULL/4 replayed x4)")
        value, ok = gpu_proof.check_captures(gpu_proof.graph_report(llm))
        # The warm-up's decode step replayed too (its prefill ran eagerly).
        assert ok and value == "3/3 sizes captured once each; replays by size 4: 5"

        runner.graphs.runner = CUDAGraphRunner()  # nothing captured: the planned replays run eagerly
        run = gpu_proof.timed_decode(llm, 3, steps=4, warmup=2)
        value, ok = gpu_proof.check_replays(run, graphs=True)
        assert not ok and "0/4 steps replayed (FULL/4 EAGER x4)" in value
        assert not gpu_proof.check_captures(gpu_proof.graph_report(llm))[1]
        assert gpu_proof.check_replays(run, graphs=False) == (value.replace(
            "0/4 steps replayed (FULL/4 EAGER x4)", "eager (FULL/4 EAGER x4)"), True)
        assert gpu_proof.sync_debug_decode(llm, gpu_proof.SYNC_CASES["greedy"]) == "n/a (CPU)"
    finally:
        gpu_measure.close(llm)


def test_a_failing_section_is_a_failed_row_and_the_table_marks_it(llama_path: Path) -> None:
    check = gpu_check.GpuCheck(llama_path, llama_path, llama_path)
    gpu_check.run_section(check, "4 bandwidth", gpu_check.check_bandwidth)  # section 3 never ran
    gpu_measure.add(check.rows, "2 decode step", "torch: graphs speed-up at batch 1", "2.50x", ">= 2x", True)
    assert check.rows[0]["ok"] is False and "needs section 3" in check.rows[0]["value"]
    lines = gpu_measure.format_table(check.rows).splitlines()
    assert lines[0].startswith("section") and lines[1].endswith("| FAIL") and lines[2].endswith("| PASS")
    assert all(column in lines[0] for column in ("backend", "dtype", "graphs", "sync"))
    assert len({line.index("| ") for line in lines}) == 1  # aligned columns


def test_the_offline_path_runs_without_ray_or_the_server_packages(llama_path: Path) -> None:
    """The GPU machines have none of Ray, FastAPI, uvicorn, openai or prometheus_client (scripts/gpu_session.sh): an
    engine with its worker in this process, sleep mode included, must not import them."""
    code = f"""
import sys
for name in ("ray", "fastapi", "uvicorn", "openai", "prometheus_client"):
    sys.modules[name] = None  # any import of them fails
from scripts import gpu_check, gpu_measure
llm = gpu_measure.make_llm({str(llama_path)!r}, max_model_len=64)
llm.generate([{{"prompt_token_ids": [11, 12, 13]}}], gpu_measure.GREEDY, use_tqdm=False)
llm.sleep(level=1)
llm.wake_up()
gpu_measure.close(llm)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
