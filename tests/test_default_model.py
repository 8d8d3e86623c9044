"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF): it answers, and its dequantized float32 twin scores a
text as transformers does from the same file. Runs only where the file was fetched (scripts/fetch_default_model.py,
which scripts/bootstrap.sh runs); skipped elsewhere, so the suite never needs the download."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.entrypoints.cli import main
from raylm.cluster.models.default_gguf import default_gguf_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(default_gguf_path() is None, reason="SmolLM2 GGUF not fetched on this machine")]
TEXT = Path(__file__).resolve().parents[1] / "scripts" / "data" / "eval_text.txt"


def test_generate_with_no_model_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "What is the capital of France?", "--max-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert "raylm: model: SmolLM2-135M-Instruct" in err
    assert out.startswith("'What is the capital of France?' -> ") and "Paris" in out


@torch.inference_mode()
def test_float32_twin_matches_transformers_on_the_same_file() -> None:
    """quantization none (the Q4_1 weights dequantized to float32): every reported log-probability of a 128-token
    window within 1e-4 of transformers'. Kept packed, the kernels multiply the same numbers in another order."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    assert path is not None
    scores = {}
    for method in ("none", "gguf"):
        llm = LLM(model=str(path), quantization=method, max_model_len=256, enable_prefix_caching=False)
        try:
            tokens = llm.get_tokenizer().encode(TEXT.read_text())[:128]
            out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=5),
                               use_tqdm=False)[0]
        finally:
            llm.shutdown()
        scores[method] = out.prompt_logprobs[1:]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    reference = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)
    gaps = {method: max(abs(lp - reference[i, t].item()) for i, position in enumerate(positions)
                        for t, lp in position.items()) for method, positions in scores.items()}
    assert gaps["none"] < 1e-4 and gaps["gguf"] < 1e-3, gaps
