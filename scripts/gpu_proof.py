"""What scripts/gpu_check.py proves about a run besides timing it: which CUDA graphs were captured (every capture
size exactly once), the graph key of every timed step (a step planned as a replay that ran eagerly fails the row),
and whether decode steps run under torch.cuda.set_sync_debug_mode("error") (any host wait in a step raises, apart
from the sampled tokens' event, runner/host_sync.py). Everything but sync-debug mode, which is CUDA's, runs on CPU
too, which is how tests/test_gpu_check.py keeps it honest between GPU runs."""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raylm.cluster import LLM
from raylm.common.sampling_params import SamplingParams
from scripts.gpu_measure import Greedy, close, decode_ms, greedy_outputs, make_llm, prompts

_ids = itertools.count()
NOT_CHECKED = "-"


@dataclass
class DecodeRun:
    batch: int
    ms: float
    forwards: list[dict[str, Any]] = field(default_factory=list)  # the timed steps' (runner/forward_log.py)


def graph_report(llm: LLM) -> dict[str, Any]:
    """The worker's cuda_graph_report: capture sizes, captures and replays per size, forwards since the last call."""
    return llm.collective_rpc("cuda_graph_report")[0]


def timed_decode(llm: LLM, batch: int, steps: int = 64, warmup: int = 8) -> DecodeRun:
    """decode_ms, with the forwards of exactly the timed steps."""
    drained: list[list[dict[str, Any]]] = []
    ms = decode_ms(llm, batch, steps, warmup, timed=lambda: drained.append(graph_report(llm)["forwards"]))
    return DecodeRun(batch, ms, drained[-1])


def keys_summary(forwards: list[dict[str, Any]]) -> str:
    """Run-length graph keys, e.g. "FULL/8 replayed x64" or "NONE/3 x1, FULL/4 replayed x7"."""
    runs = [(key, len(list(group))) for key, group in itertools.groupby(f["key"] for f in forwards)]
    return ", ".join(f"{key} x{count}" for key, count in runs) or "no forward"


def check_replays(run: DecodeRun, graphs: bool) -> tuple[str, bool]:
    """(value, ok) of one timed batch: with graphs every step replayed (a FULL/<size> key with "replayed"), else
    none did."""
    replayed = sum(f["replayed"] for f in run.forwards)
    if graphs:
        ok = bool(run.forwards) and replayed == len(run.forwards)
        return f"{run.ms:.3f} ms; {replayed}/{len(run.forwards)} steps replayed ({keys_summary(run.forwards)})", ok
    ok = bool(run.forwards) and replayed == 0
    return f"{run.ms:.3f} ms; eager ({keys_summary(run.forwards)})", ok


def check_captures(report: dict[str, Any]) -> tuple[str, bool]:
    """(value, ok): every capture size captured exactly once, and nothing else."""
    sizes, captured = report["capture_sizes"], {int(k): v for k, v in report["captured"].items()}
    ok = bool(sizes) and captured == dict.fromkeys(sizes, 1)
    replayed = Counter({int(k): v for k, v in report["replayed"].items()})
    busiest = ", ".join(f"{size}: {count}" for size, count in replayed.most_common(4))
    return f"{len(captured)}/{len(sizes)} sizes captured once each; replays by size {busiest or 'none'}", ok


SYNC_CASES: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0)],
    "top-k/top-p/min-p": [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1)],
    "mixed greedy and random": [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=5, seed=2)],
    "penalties": [SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5,
                                 presence_penalty=0.3)],
    "logprobs": [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.7, logprobs=2, seed=3)],
}


def sync_debug_decode(llm: LLM, params: list[SamplingParams], batch: int = 8, steps: int = 4) -> str:
    """Decode steps of `batch` requests (params cycled over them) under sync-debug mode "error", after their prefill
    and two decodes ran normally: "none" when no step waited for the device, else the error's first line. Not on
    CPU (the mode is CUDA's)."""
    if not torch.cuda.is_available():
        return "n/a (CPU)"
    engine = llm.llm_engine
    ids = [f"sync-{next(_ids)}" for _ in range(batch)]
    for rid, prompt, p in zip(ids, prompts(batch, 8, 8, engine.model_info.vocab_size, seed=7),
                              itertools.cycle(params)):
        engine.add_request(rid, prompt, dataclasses.replace(p, max_tokens=steps + 8, ignore_eos=True),
                           output_kind="final")
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    result = "none"
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            engine.step()
    except RuntimeError as err:
        result = f"SYNC: {str(err).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def greedy_tokens_and_replays(model: Path, batch: list[dict[str, list[int]]], **settings: Any
                              ) -> tuple[list[Greedy], int]:
    """Greedy tokens (with their top-5), and how many forwards of the run replayed a captured graph."""
    llm = make_llm(model, **settings)
    try:
        graph_report(llm)  # forget the warm-up's forwards
        outputs = greedy_outputs(llm, batch)
        return outputs, sum(forward["replayed"] for forward in graph_report(llm)["forwards"])
    finally:
        close(llm)
