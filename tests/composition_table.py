"""The composition matrix: every feature on every path a user takes to it, as one table.

Four dimensions (feature, weights, layout, front end). The full product is 660 cells; the tests run a covering set in
which every pair of values appears at least once (pairwise), generated here from the table. A feature set per request
(a grammar, n, logprobs, a stop string, a repeated prompt) needs no engine of its own: one engine of the `plain` class
answers all of them, so the covering runs over engine classes (those features together, or one engine feature) and a
plain cell stands for every per-request feature. A pair raylm cannot run is listed in REFUSED with the words its
error must contain; every other pair must appear in a cell that works. The docs table (docs/composition.md) is
written from this module by scripts/composition_table.py.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

REQUEST_FEATURES = ("json_schema", "tool_call", "prefix_caching", "n2", "logprobs", "stop")
ENGINE_FEATURES = ("ngram", "draft_model", "lora", "priority", "kv_offload")  # each needs engine settings of its own
FEATURES = REQUEST_FEATURES + ENGINE_FEATURES
WEIGHTS = ("gguf_q4_1", "int8", "int4", "float32", "bfloat16")
LAYOUTS = ("one", "tp2", "pp2", "dp2")
FRONTENDS = ("offline", "http", "serve")
DIMENSIONS: dict[str, tuple[str, ...]] = {"feature": FEATURES, "weights": WEIGHTS, "layout": LAYOUTS,
                                          "frontend": FRONTENDS}
# What the covering runs over: engine classes in place of features.
ENGINE_DIMENSIONS: dict[str, tuple[str, ...]] = {**DIMENSIONS, "feature": ENGINE_FEATURES + ("plain",)}

WHAT = {
    "json_schema": "structured output, a JSON schema (`response_format` / `StructuredOutputsParams(json=...)`)",
    "tool_call": "a tool call forced by `tool_choice: required` (HTTP) / `LLM.chat(tools=..., tool_choice=...)`",
    "ngram": "speculative decoding, ngram (prompt lookup)",
    "draft_model": "speculative decoding, a draft model",
    "lora": "a LoRA adapter (PEFT) on the request",
    "prefix_caching": "prefix caching: a prompt's second run hits the cache",
    "n2": "`n: 2`, seeded sampling",
    "logprobs": "`logprobs: 2`",
    "stop": "a stop string",
    "priority": "`scheduling_policy: priority`, requests with priorities",
    "kv_offload": "KV offload to host memory (`kv_offloading_size`)",
    "gguf_q4_1": "a GGUF file of Q4_1 blocks, the default model's format",
    "int8": "a float checkpoint, `quantization: int8`",
    "int4": "a float checkpoint, `quantization: int4`",
    "float32": "float32 safetensors",
    "bfloat16": "bfloat16 safetensors",
    "one": "one device, in the engine's process",
    "tp2": "`tensor_parallel_size: 2`, workers on Ray",
    "pp2": "`pipeline_parallel_size: 2`, workers on Ray",
    "dp2": "`data_parallel_size: 2`, engines on Ray",
    "offline": "`LLM.generate` / `LLM.chat`",
    "http": "the OpenAI server, `raylm serve --no-ray`",
    "serve": "Ray Serve (`build_openai_app`)",
}

# A pair raylm refuses -> the words its error must contain, and why (for the docs table).
REFUSED: dict[frozenset[tuple[str, str]], tuple[str, str]] = {
    frozenset({("feature", "ngram"), ("layout", "pp2")}): (
        "pipeline_parallel_size", "drafts are verified on the last stage; the first would need them a step early"),
    frozenset({("feature", "draft_model"), ("layout", "pp2")}): (
        "pipeline_parallel_size", "drafts are verified on the last stage; the first would need them a step early"),
    frozenset({("feature", "kv_offload"), ("layout", "tp2")}): (
        "engines of one device", "KV connectors run on engines of one device; data_parallel_size scales them"),
    frozenset({("feature", "kv_offload"), ("layout", "pp2")}): (
        "engines of one device", "KV connectors run on engines of one device; data_parallel_size scales them"),
}


@dataclass(frozen=True)
class Cell:
    feature: str  # an engine feature, or "plain": every per-request feature on one engine
    weights: str
    layout: str
    frontend: str

    @property
    def features(self) -> tuple[str, ...]:
        return REQUEST_FEATURES if self.feature == "plain" else (self.feature,)

    def values(self) -> dict[str, str]:
        return {"feature": self.feature, "weights": self.weights, "layout": self.layout, "frontend": self.frontend}

    def pairs(self) -> set[frozenset[tuple[str, str]]]:
        return {frozenset(pair) for pair in itertools.combinations(self.values().items(), 2)}

    def refusal(self) -> tuple[str, str] | None:
        """The (words, why) of the first refused pair in this cell, or None where every pair is allowed."""
        return next((REFUSED[pair] for pair in sorted(self.pairs(), key=_pair_key) if pair in REFUSED), None)

    @property
    def id(self) -> str:
        return f"{self.feature}-{self.weights}-{self.layout}-{self.frontend}"


def _pair_key(pair: frozenset[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(pair))


def all_pairs(dimensions: dict[str, tuple[str, ...]] = DIMENSIONS) -> list[frozenset[tuple[str, str]]]:
    """Every pair of values of two different dimensions, in a fixed order."""
    pairs = []
    for (dim_a, values_a), (dim_b, values_b) in itertools.combinations(dimensions.items(), 2):
        pairs += [frozenset({(dim_a, a), (dim_b, b)}) for a in values_a for b in values_b]
    return pairs


def _cost(dim: str, value: str) -> int:
    """Cheaper values first when a choice covers nothing new: engines in this process before Ray, Ray before Serve."""
    return ENGINE_DIMENSIONS[dim].index(value) if dim != "layout" else ("one", "dp2", "pp2", "tp2").index(value)


def covering_cells() -> list[Cell]:
    """Working cells covering every allowed pair, then one cell per refused pair (the rest of it allowed). Greedy, as
    AETG: each cell starts from the first uncovered pair and takes, dimension by dimension, the value that covers the
    most new pairs without forming a refused one."""
    uncovered = [pair for pair in all_pairs(ENGINE_DIMENSIONS) if pair not in REFUSED]
    cells: list[Cell] = []
    while uncovered:
        chosen = dict(uncovered[0])
        for dim, values in ENGINE_DIMENSIONS.items():
            if dim in chosen:
                continue
            best = min((value for value in values if not _refused({**chosen, dim: value})),
                       key=lambda value: (-_new_pairs({**chosen, dim: value}, uncovered), _cost(dim, value)))
            chosen[dim] = best
        cell = Cell(**chosen)
        cells.append(cell)
        uncovered = [pair for pair in uncovered if pair not in cell.pairs()]
    for pair in REFUSED:
        chosen = dict(pair)
        for dim, values in ENGINE_DIMENSIONS.items():
            if dim not in chosen:
                chosen[dim] = min((v for v in values if not _refused({**chosen, dim: v}, but=pair)),
                                  key=lambda v, d=dim: _cost(d, v))
        cells.append(Cell(**chosen))
    return cells


def _refused(chosen: dict[str, str], but: frozenset[tuple[str, str]] | None = None) -> bool:
    pairs = {frozenset(pair) for pair in itertools.combinations(chosen.items(), 2)}
    return any(pair in REFUSED and pair != but for pair in pairs)


def _new_pairs(chosen: dict[str, str], uncovered: list[frozenset[tuple[str, str]]]) -> int:
    pairs = {frozenset(pair) for pair in itertools.combinations(chosen.items(), 2)}
    return sum(pair in pairs for pair in uncovered)


def covered_pairs(cells: list[Cell]) -> set[frozenset[tuple[str, str]]]:
    """The feature-level pairs that working cells show: a plain cell shows each of its per-request features."""
    shown: set[frozenset[tuple[str, str]]] = set()
    for cell in cells:
        if cell.refusal() is None:
            for feature in cell.features:
                shown |= Cell(feature, cell.weights, cell.layout, cell.frontend).pairs()
    return shown
