"""Speculative decoding, side by side in one run: output tokens/s without drafts, with ngram drafts and with a draft
model, at batch 1, 4 and 16, on two workloads; each speculative engine's acceptance rate, mean acceptance length and
tokens per request per step beside it.

The target is the 107M copy model (scripts/make_copy_model.py: the `100m` shape, two layers set by hand to an
induction circuit, the cost per token of the random 107M model), the draft model its first two layers.
- repeat: each prompt holds a 128-token passage, a separator, then the passage's first 4 tokens; greedy decoding
  continues the passage (an edit / extract task: the output repeats the prompt).
- fresh: a 128-token prompt of distinct tokens, sampled at temperature 1 (seeded); the output repeats nothing.
Engines live in this process and take turns (each request batch once per engine per round, the order rotating), so
the machine's noise hits all alike; printed: the median of the rounds and the median of the per-round ratios.

    python scripts/bench_spec.py [--rounds 3] [--output-len 96] [--batch-sizes 1 4 16]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from raylm.cluster.core.spec_decode import SpecDecodingStats  # noqa: E402
from raylm.cluster.tools.draft_checkpoint import make_draft_checkpoint  # noqa: E402
from scripts.bench_common import MODELS_DIR, machine_line  # noqa: E402
from scripts.make_copy_model import copy_model  # noqa: E402

BOS, VOCAB, PASSAGE, SEPARATOR = 0, 2048, 128, [5, 6, 7]
ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_gib=0.5)


@dataclass
class Cell:
    times: list[float] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    spec: SpecDecodingStats | None = None
    outputs: list[list[int]] = field(default_factory=list)


def workload(name: str, batch: int, output_len: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed * 1000 + batch)
    prompts, params = [], []
    for i in range(batch):
        passage = rng.sample(range(8, VOCAB), PASSAGE)  # distinct tokens: no bigram recurs by chance
        if name == "repeat":
            prompts.append([BOS, *passage, *SEPARATOR, *passage[:4]])
            params.append(SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        else:
            prompts.append([BOS, *passage])
            params.append(SamplingParams(temperature=1.0, seed=seed + i, max_tokens=output_len, ignore_eos=True))
    return prompts, params


def run_once(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], cell: Cell) -> None:
    engine_core = llm.llm_engine.engine_core
    drafts = engine_core.scheduler.drafts
    steps_before = engine_core.num_steps
    spec_before = drafts.stats.copy() if drafts is not None else None
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    cell.times.append(time.perf_counter() - start)
    cell.outputs = [list(o.outputs[0].token_ids) for o in outputs]
    cell.tokens = sum(len(tokens) for tokens in cell.outputs)
    cell.steps = engine_core.num_steps - steps_before
    if drafts is not None and spec_before is not None:
        delta = drafts.stats.minus(spec_before)
        cell.spec = delta if cell.spec is None else SpecDecodingStats.total([cell.spec, delta])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of both methods")
    parser.add_argument("--draft-layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    before = machine_line()
    print(before, file=sys.stderr)

    target = copy_model()
    draft = make_draft_checkpoint(target, MODELS_DIR / f"bench-100m-copy-draft{args.draft_layers}", args.draft_layers)
    configs: dict[str, dict[str, Any] | None] = {
        "off": None,
        f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 5},
        f"draft k={args.k}": {"method": "draft_model", "num_speculative_tokens": args.k, "model": str(draft)},
    }
    engines = {name: LLM(model=str(target), speculative_config=spec, disable_log_stats=True, **ENGINE)
               for name, spec in configs.items()}
    cells: dict[tuple[str, int, str], Cell] = {}
    jobs = [(w, b) for w in ("repeat", "fresh") for b in args.batch_sizes]
    for llm in engines.values():  # warm-up: first-seen shapes are slow on CPU
        for w, b in jobs:
            run_once(llm, *workload(w, b, 8, seed=99), Cell())
    names = list(engines)
    for round_index in range(args.rounds):
        for w, b in jobs:
            prompts, params = workload(w, b, args.output_len, seed=round_index)
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                cell = cells.setdefault((w, b, name), Cell())
                run_once(engines[name], prompts, params, cell)
                print(f"  round {round_index + 1} {w} batch {b} {name}: {cell.times[-1]:.2f} s", file=sys.stderr)
            if w == "repeat":
                same = {tuple(map(tuple, cells[(w, b, name)].outputs)) for name in names}
                assert len(same) == 1, f"greedy outputs differ between engines ({w}, batch {b})"
    for llm in engines.values():
        llm.shutdown()
    print_table(cells, names, jobs, args)
    print(f"before: {before}\nafter:  {machine_line()}")


def print_table(cells: dict[tuple[str, int, str], Cell], names: list[str], jobs: list[tuple[str, int]],
                args: argparse.Namespace) -> None:
    print(f"\n107M copy model, {args.output_len} output tokens per request, fp32, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} interleaved rounds; repeat: greedy, fresh: temperature 1")
    print(f"{'workload':<9}{'batch':>6}  {'engine':<12}{'tok/s':>8}{'spread':>8}{'speedup':>16}{'accepted':>10}"
          f"{'mean len':>10}{'tok/step':>10}")
    for w, b in jobs:
        base = cells[(w, b, "off")]
        for name in names:
            cell = cells[(w, b, name)]
            median = statistics.median(cell.times)
            spread = (max(cell.times) - min(cell.times)) / median * 100
            speedup, accepted, mean_len = "", "", ""
            if name != "off":
                paired = statistics.median(theirs / ours for ours, theirs in zip(cell.times, base.times))
                speedup = f"{statistics.median(base.times) / median:.2f}x ({paired:.2f}x)"
                if cell.spec is not None and cell.spec.num_draft_tokens:
                    accepted = f"{100 * cell.spec.acceptance_rate:.0f}%"
                    mean_len = f"{cell.spec.mean_acceptance_length:.2f}"
            per_step = cell.tokens / b / max(cell.steps, 1)
            print(f"{w:<9}{b:>6}  {name:<12}{cell.tokens / median:>8.1f}{spread:>7.0f}%{speedup:>16}{accepted:>10}"
                  f"{mean_len:>10}{per_step:>10.2f}")
    print("speedup: ratio of median times (in brackets the median of the per-round ratios); accepted: drafts "
          "accepted / drafts verified; mean len: tokens per step of a request with drafts; tok/step: output tokens "
          "per request per engine step (the prefill step included)")


if __name__ == "__main__":
    main()
