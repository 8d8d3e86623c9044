"""scripts/gpu_check.py runs only on a GPU, rarely: its sections and measurements run here on CPU on tiny inputs, so
an API change breaks a test instead of the next GPU run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from scripts import gpu_check, gpu_measure
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
    assert [(r["metric"], r["ok"]) for r in check.rows] == [
        ("triton", None), ("flash_attn", None), ("torch graphs vs torch eager, fp32", True),
        ("mixtral graphs vs eager, bf16 (grouped matmul)", True)]
    assert check.rows[-1]["value"] == "8/8 prompts identical"


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
    tokens = gpu_measure.greedy_tokens(qwen, batch, dtype="bfloat16", max_model_len=64)
    assert [len(t) for t in tokens] == [gpu_measure.GREEDY.max_tokens] * 3


def test_a_failing_section_is_a_failed_row_and_the_table_marks_it(llama_path: Path) -> None:
    check = gpu_check.GpuCheck(llama_path, llama_path, llama_path)
    gpu_check.run_section(check, "4 bandwidth", gpu_check.check_bandwidth)  # section 3 never ran
    gpu_measure.add(check.rows, "2 decode step", "torch: graphs speed-up at batch 1", "2.50x", ">= 2x", True)
    assert check.rows[0]["ok"] is False and "needs section 3" in check.rows[0]["value"]
    lines = gpu_measure.format_table(check.rows).splitlines()
    assert lines[0].startswith("section") and lines[1].endswith("| FAIL") and lines[2].endswith("| PASS")
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
