"""Multi-LoRA serving checked against PEFT: one batch mixing the base model and three adapters (rslora, q/v-only and
all seven linears; ranks 4 to 8) gives PEFT's greedy outputs per request, under preemption, with fewer device slots
than adapters, under TP=2; the host cache evicts and reloads without changing outputs; prefix caching never crosses
adapters; bad adapters fail with clear errors and leave the loaded ones working."""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.common.lora_request import LoRARequest
from raylm.runner import cpu_kernels
from raylm.runner.input_batch import CachedRequestState, InputBatch
from raylm.runner.lora.punica import PunicaWrapper, SlotWeights
from raylm.runner.lora.worker_manager import LoRAManager
from scripts.gguf_to_safetensors import write_float32_checkpoint
from tests.gguf_files import write_gguf
from tests.lora_utils import make_adapter, peft_greedy
from tests.reference import TOP_K, check_logprobs_close

MAX_TOKENS = 10
ENGINE = dict(max_model_len=128, block_size=4, disable_log_stats=True, enable_lora=True, max_lora_rank=8)
Result = list[tuple[list[int], list[dict[int, float]]]]


def make_prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in (3, 9, 17)]


@pytest.fixture(scope="module")
def adapters(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": make_adapter(llama_path, root / "all", seed=1, r=8),
        "qv-rslora": make_adapter(llama_path, root / "qv-rslora", seed=2, r=4, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj"], use_rslora=True),
        "mlp": make_adapter(llama_path, root / "mlp", seed=3, r=6, target_modules=["gate_proj", "down_proj", "o_proj"]),
    }


@pytest.fixture(scope="module")
def lora_requests(adapters: dict[str, Path]) -> list[LoRARequest | None]:
    """The mixed batch's adapters, one request group each: the base model, then the three adapters."""
    return [None] + [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]


@pytest.fixture(scope="module")
def reference(llama_path: Path, lora_requests: list[LoRARequest | None]) -> Result:
    """PEFT's greedy outputs for every (adapter, prompt) pair of the mixed batch."""
    results: Result = []
    for lora in lora_requests:
        results += peft_greedy(llama_path, None if lora is None else Path(lora.lora_path), make_prompts(), MAX_TOKENS)
    return results


def generate(llm: LLM, lora_requests: list[LoRARequest | None]) -> Result:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    prompts = [{"prompt_token_ids": p} for _ in lora_requests for p in make_prompts()]
    per_prompt = [lora for lora in lora_requests for _ in make_prompts()]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def lora_managers(llm: LLM) -> list[LoRAManager]:
    return llm.collective_rpc(lambda worker: worker.model_runner.lora_manager)


@pytest.mark.parametrize("settings", [
    dict(max_loras=3),  # the base model and all three adapters in one batch
    dict(max_loras=3, num_gpu_blocks_override=14),  # a KV pool too small for the batch: preemption
    dict(max_loras=1, max_cpu_loras=2),  # one device slot: the scheduler defers the other adapters
    dict(max_loras=3, custom_ops="none"),  # torch's products instead of the fused CPU kernel
], ids=["mixed", "preemption", "one-slot", "torch-products"])
def test_mixed_batch_matches_peft(llama_path: Path, lora_requests: list[LoRARequest | None], reference: Result,
                                  settings: dict[str, Any]) -> None:
    llm = LLM(model=str(llama_path), **ENGINE, **settings)
    ours = generate(llm, lora_requests)
    assert check_logprobs_close(reference, ours, "lora") <= 1
    scheduler = llm.llm_engine.engine_core.scheduler
    if "num_gpu_blocks_override" in settings:
        assert scheduler.num_preemptions > 0
    (manager,) = lora_managers(llm)
    assert (manager.punica.kernels is None) == (settings.get("custom_ops") == "none" or cpu_kernels.load() is None)
    assert manager.slot_ids.count(None) + len([i for i in manager.slot_ids if i is not None]) == settings["max_loras"]
    llm.shutdown()


def test_adapters_change_the_output(llama_path: Path, lora_requests: list[LoRARequest | None],
                                    reference: Result) -> None:
    """The oracle is not vacuous: each adapter's greedy tokens differ from the base model's on some prompt."""
    num_prompts = len(make_prompts())
    base = [tokens for tokens, _ in reference[:num_prompts]]
    for i in range(1, len(lora_requests)):
        assert [tokens for tokens, _ in reference[i * num_prompts:(i + 1) * num_prompts]] != base


def test_lru_cache_evicts_and_reloads(llama_path: Path, lora_requests: list[LoRARequest | None],
                                      reference: Result) -> None:
    """One slot and one adapter in host memory: every switch of adapter reads it from disk again, outputs unchanged."""
    llm = LLM(model=str(llama_path), **ENGINE, max_loras=1, max_cpu_loras=1)
    num_prompts = len(make_prompts())
    for _ in range(2):
        for i, lora in enumerate(lora_requests[1:], start=1):
            ours = generate(llm, [lora])
            assert check_logprobs_close(reference[i * num_prompts:(i + 1) * num_prompts], ours, lora.lora_name) <= 1
    (manager,) = lora_managers(llm)
    assert manager.num_disk_loads == 6 and len(manager.cpu_cache) == 1
    assert llm.list_loras() == {lora_requests[-1].lora_int_id}
    assert llm.remove_lora(lora_requests[-1].lora_int_id) and llm.list_loras() == set()
    llm.shutdown()


def test_prefix_cache_never_crosses_adapters(llama_path: Path, lora_requests: list[LoRARequest | None],
                                             reference: Result) -> None:
    llm = LLM(model=str(llama_path), **ENGINE, max_loras=3, enable_prefix_caching=True)
    manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    num_prompts = len(make_prompts())
    for i, lora in enumerate(lora_requests):  # one at a time: every prompt's blocks are cached before the next
        hits = manager.prefix_cache_hits
        ours = generate(llm, [lora])
        assert manager.prefix_cache_hits == hits, "a prompt computed under another adapter was reused"
        assert check_logprobs_close(reference[i * num_prompts:(i + 1) * num_prompts], ours, f"group {i}") <= 1
    hits = manager.prefix_cache_hits
    assert check_logprobs_close(reference[num_prompts:2 * num_prompts], generate(llm, [lora_requests[1]]), "again") <= 1
    assert manager.prefix_cache_hits > hits, "the same adapter and prompt again hits its own blocks"
    llm.shutdown()


def test_bad_adapters_are_refused(llama_path: Path, adapters: dict[str, Path], tmp_path: Path,
                                  lora_requests: list[LoRARequest | None], reference: Result) -> None:
    llm = LLM(model=str(llama_path), **ENGINE, max_loras=2, lora_modules=[f"all={adapters['all']}"])
    other_base = make_adapter_for_other_model(tmp_path)
    head = make_adapter(llama_path, tmp_path / "head", seed=4, r=4, target_modules=["q_proj", "lm_head"])
    big = make_adapter(llama_path, tmp_path / "big", seed=5, r=16)
    cases = {
        "over max_lora_rank (8)": LoRARequest("big", 10, str(big)),
        "not LoRA-capable modules": LoRARequest("head", 11, str(head)),
        "trained for another base model": LoRARequest("other", 12, str(other_base)),
        "is not a PEFT adapter folder": LoRARequest("missing", 13, str(tmp_path / "nowhere")),
        "already adapter 'all'": LoRARequest("again", 1, str(big)),
    }
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for message, lora in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False, lora_request=lora)
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.add_lora(lora)
    with pytest.raises(ValueError, match="no adapter of that name"):
        llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False, lora_request="unknown")
    # The adapter loaded at start-up still serves, by name, as PEFT does.
    ours = generate(llm, ["all"])  # type: ignore[list-item]
    num_prompts = len(make_prompts())
    assert check_logprobs_close(reference[num_prompts:2 * num_prompts], ours, "all") <= 1
    llm.shutdown()


def make_adapter_for_other_model(tmp_path: Path) -> Path:
    from raylm.cluster.models.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "other", num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512)
    return make_adapter(other, tmp_path / "other-adapter", seed=6, r=4)


def test_lora_settings_are_checked(llama_path: Path) -> None:
    with pytest.raises(ValueError, match="max_loras: LoRA settings need enable_lora=True"):
        LLM(model=str(llama_path), max_loras=2)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LLM(model=str(llama_path), enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="is not name=path"):
        LLM(model=str(llama_path), enable_lora=True, lora_modules=["no-path"])
    llm = LLM(model=str(llama_path), max_model_len=64, disable_log_stats=True)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate([{"prompt_token_ids": [5]}], use_tqdm=False, lora_request=LoRARequest("a", 1, "/tmp/a"))
    llm.shutdown()



def test_adapter_over_a_gguf_base_matches_peft(llama_path: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """A quantized base keeps packed blocks, not a weight: the adapter's slots take the layer's shape. The reference is
    PEFT over the GGUF file's own float32 weights."""
    gguf_path = write_gguf(llama_path, tmp_path / "llama-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    twin = write_float32_checkpoint(gguf_path, tmp_path / "twin")
    prompts = make_prompts()
    reference = peft_greedy(twin, adapters["all"], prompts, MAX_TOKENS)
    llm = LLM(model=str(gguf_path), tokenizer=str(llama_path), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=LoRARequest("all", 1, str(adapters["all"])))
    assert check_logprobs_close(reference, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs],
                                "lora-gguf") <= 1
    llm.shutdown()

@pytest.mark.slow
def test_tensor_parallel_matches_peft(ray_cluster: Any, llama_path: Path, lora_requests: list[LoRARequest | None],
                                      reference: Result) -> None:
    """TP=2: lora_b sharded like the column-parallel weights, lora_a like the row-parallel ones."""
    llm = LLM(model=str(llama_path), tensor_parallel_size=2, distributed_executor_backend="ray", max_loras=3,
              num_gpu_blocks_override=14, **ENGINE)
    ours = generate(llm, lora_requests)
    assert check_logprobs_close(reference, ours, "lora tp2") <= 1
    layouts = llm.collective_rpc(lambda worker: (
        tuple(worker.model_runner.model.model.layers[0].self_attn.qkv_proj.lora.lora_b.shape[:2]),
        worker.model_runner.model.model.layers[0].self_attn.qkv_proj.lora.output_slices[1][1]))
    # 3 slots of rank 8; k's lora_b columns: one of the two KV heads (head_dim 32) per rank
    assert layouts[0] == layouts[1] == ((3, 8), 32)
    llm.shutdown()


# (token slots, (runs computed in place?, layout of the other LoRA tokens)): decodes spread over the slots with
# base-model tokens between them; two slots that are not the first; a long prefill beside decodes; many tokens of one
# adapter beside one of each other (padding would waste too much); prefills only (in place); one adapter's short
# prompt first and base-model tokens after (no gather, no index_add); a single-token step.
PRODUCT_CASES = {
    "decode-mixed": ([0, 2, -1, 1, 1, -1, 0, 3, 2], (False, "padded")),
    "later-slots": ([2, 1, 2, 1, 2], (False, "padded")),
    "prefill-beside-decodes": ([3] * 40 + [-1, 0, 2, -1, 1], (True, "padded")),
    "uneven-slots": ([0] * 20 + [1, 2, -1, 3, 0], (False, "segments")),
    "prefills-only": ([-1] * 3 + [2] * 40 + [1] * 33, (True, "none")),
    "one-adapter-first": ([1] * 12 + [-1] * 5, (False, "in-order")),
    "one-token": ([2], (False, "in-order")),
}


def plan(punica: PunicaWrapper) -> tuple[bool, str]:
    grouped = "in-order" if punica.in_order else "segments" if punica.segments else "padded"
    return bool(punica.runs), grouped if punica.num_grouped else "none"


# (rank, in_features, output slice sizes) for the fused kernel's column loops: under 16 columns in all (tails only),
# whole 16-float vectors, and 24 shrunk columns (a last vector overlapping the one before) with 40-column slices.
PRODUCT_SHAPES = {"small": (4, 5, (3, 6)), "vectors": (16, 40, (32, 20)), "overlap": (12, 40, (24, 40))}


@pytest.mark.parametrize("path", ["torch", "cpu-kernel", "cpu-kernel-avx2"])
@pytest.mark.parametrize("shape", PRODUCT_SHAPES.values(), ids=PRODUCT_SHAPES.keys())
@pytest.mark.parametrize("slots,layout", PRODUCT_CASES.values(), ids=PRODUCT_CASES.keys())
def test_lora_product_matches_the_loop_over_tokens(slots: list[int], layout: tuple[bool, str],
                                                   shape: tuple[int, int, tuple[int, ...]], path: str) -> None:
    """The product equals x @ A[slot].T @ B[slot].T token by token, per output slice, whichever plan the step takes
    (torch's products) or with the fused CPU kernel; base-model tokens and the forward's padding rows are left exactly
    as they were."""
    torch.manual_seed(0)
    load = {"torch": None, "cpu-kernel": cpu_kernels.load, "cpu-kernel-avx2": cpu_kernels.load_avx2}[path]
    kernels = None if load is None else load()
    if load is not None and kernels is None:
        pytest.skip("raylm's CPU kernels (for AVX2: on a CPU with AVX2 + FMA) could not be built here")
    max_loras, (rank, in_features, sizes) = 4, shape  # two output slices (q and kv, say)
    punica = PunicaWrapper(128, max_loras, torch.device("cpu"), kernels)
    punica.update(np.array(slots))
    if kernels is None:
        assert plan(punica) == layout
    # Per slot and slice, ranks 4 and 3 (a rank below max_lora_rank leaves zero rows), laid out as LoRASlots does.
    a = [[torch.randn(rank - i, in_features) for i in range(len(sizes))] for _ in range(max_loras)]
    b = [[torch.randn(size, rank - i) for i, size in enumerate(sizes)] for _ in range(max_loras)]
    output_slices = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
    lora_a_t = torch.zeros(max_loras, in_features, len(sizes) * rank)
    lora_b = torch.zeros(max_loras, rank, sum(sizes))
    for slot in range(max_loras):
        for i, (offset, size) in enumerate(output_slices):
            r = rank - i
            lora_a_t[slot, :, i * rank:i * rank + r] = a[slot][i].T
            lora_b[slot, :r, offset:offset + size] = b[slot][i].T
    padding = 3  # rows of the forward after the step's tokens
    x, y = torch.randn(len(slots) + padding, in_features), torch.randn(len(slots) + padding, sum(sizes))
    expected, out = y.clone(), y.clone()
    punica.add_lora_linear(out, x, SlotWeights(lora_a_t, lora_b, output_slices))
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[t] += torch.cat([x[t] @ a[slot][i].T @ b[slot][i].T for i in range(len(sizes))])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)  # fp32 sums in another order
    untouched = [t for t, slot in enumerate(slots) if slot < 0] + list(range(len(slots), len(slots) + padding))
    assert torch.equal(out[untouched], y[untouched])


def test_a_step_without_adapters_skips_the_product() -> None:
    punica = PunicaWrapper(16, 2, torch.device("cpu"))
    punica.update(np.array([0, -1]))
    assert punica.has_lora
    punica.update(np.array([-1, -1, -1]))
    assert not punica.has_lora


def test_input_batch_rows_carry_their_adapter() -> None:
    """Rows keep their adapter id through condense; an adapter no row uses any more is forgotten (no growth)."""
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=8, vocab_size=100)
    loras = [None, LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b"), LoRARequest("a", 1, "/a")]
    for i, lora in enumerate(loras):
        batch.add_request(CachedRequestState(f"r{i}", [5, 6], [], SamplingParams(seed=1), [i], 0, lora))
    assert list(batch.request_lora_mapping[:4]) == [0, 1, 2, 1] and set(batch.lora_id_to_request) == {1, 2}
    batch.remove_request("r1")
    assert set(batch.lora_id_to_request) == {1, 2}  # r3 still uses adapter 1
    batch.remove_request("r2")
    batch.condense()
    assert list(batch.request_lora_mapping[:batch.num_rows]) == [0, 1] and set(batch.lora_id_to_request) == {1}
    batch.remove_request("r3")
    assert batch.lora_id_to_request == {}
