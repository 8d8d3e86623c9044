"""raylm.data on a Ray cluster of two nodes (ray.cluster_utils.Cluster on this machine; each node declares one
`replica_slot`, as a GPU node holds one GPU replica): two replicas running, one on each node,
every row equal to LLM.generate (greedy, token-exact) after a sort by id; and an autoscaling pool of concurrency=(1, 2)
that grows under load and shrinks after, as Ray Data's actor pool reports it."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.data
from ray._private.state import actors
from ray.cluster_utils import Cluster
from ray.data._internal.execution.execution_callback import ExecutionCallback
from ray.data.context import DataContext

from raylm.cluster.entrypoints.llm import LLM
from raylm.common.sampling_params import SamplingParams
from raylm.data import EngineProcessorConfig, build_processor

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"}}  # the row functions, by name
ENGINE = {"max_model_len": 128, "num_gpu_blocks_override": 128, "max_num_seqs": 64, "block_size": 16}
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
SLOT = "replica_slot"
ONE_PER_NODE = {"bundles": [{"CPU": 0.5, SLOT: 1}]}  # a replica takes its node's one slot
NUM_ROWS = 200


def prompt_of(i: int) -> str:
    return f"row {i}: " + " ".join(str(i * k % 97) for k in range(1 + i % 7))


def messages_of(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt_of(i)}]


def to_request(row: dict[str, Any]) -> dict[str, Any]:
    i = row["id"]
    return {"id": i, **({"prompt": prompt_of(i)} if i % 2 == 0 else {"messages": messages_of(i)}),
            "sampling_params": GREEDY}


class PoolSizes(ExecutionCallback):
    """What the replicas' actor pool reports at each step of Ray Data's executor: (running, pending, active)."""

    seen: list[tuple[int, int, int]] = []

    def on_execution_step(self, executor: Any) -> None:
        for op in executor._topology:  # the executor's operators; Ray Data gives no public handle on them
            for pool in op.get_autoscaling_actor_pools():
                sizes = (pool.num_running_actors(), pool.num_pending_actors(), pool.num_active_actors())
                if not PoolSizes.seen or PoolSizes.seen[-1] != sizes:
                    PoolSizes.seen.append(sizes)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    if ray.is_initialized():  # a local Ray that an earlier test started
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {SLOT: 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={SLOT: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=RUNTIME_ENV)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> dict[int, list[int]]:
    """id -> LLM.generate's tokens: even ids as prompts, odd ids as chat messages (LLM.chat)."""
    llm = LLM(model=str(llama_path), distributed_executor_backend="uni", **ENGINE)
    try:
        ids = range(NUM_ROWS)
        params = SamplingParams(**GREEDY)
        prompts = llm.generate([prompt_of(i) for i in ids if i % 2 == 0], params, use_tqdm=False)
        chats = llm.chat([messages_of(i) for i in ids if i % 2 == 1], params, use_tqdm=False)
    finally:
        llm.shutdown()
    outputs = iter(prompts), iter(chats)
    return {i: next(outputs[i % 2]).outputs[0].token_ids for i in ids}


def run_processor(config: EngineProcessorConfig, num_rows: int, postprocess: Any = None,
                  **context_fields: Any) -> list[dict[str, Any]]:
    """The processor's rows sorted by id, with what the replicas' actor pool reported on the way in PoolSizes.seen."""
    context = DataContext.get_current().copy()
    context.custom_execution_callback_classes = [PoolSizes]
    for name, value in context_fields.items():
        setattr(context, name, value)
    PoolSizes.seen.clear()
    with DataContext.current(context):
        rows = build_processor(config, to_request, postprocess)(ray.data.range(num_rows)).take_all()
    return sorted(rows, key=lambda row: row["id"])


def postprocess(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "tokens": row["generated_tokens"], "text": row["generated_text"],
            "reason": row["finish_reason"], "n_in": row["num_input_tokens"], "n_out": row["num_generated_tokens"],
            "ttft": row["time_to_first_token"], "took": row["time_taken_llm"]}


def test_two_replicas_on_two_nodes_equal_llm_generate(two_nodes: Cluster, llama_path: Path,
                                                      reference: dict[int, list[int]]) -> None:
    config = EngineProcessorConfig(model_source=str(llama_path), engine_kwargs=ENGINE, concurrency=2, batch_size=16,
                                   max_concurrent_batches=2, placement_group_config=ONE_PER_NODE)
    earlier_actors = set(actors())
    # Both replicas up before the first batch, so that neither finishes the rows before the other has started.
    rows = run_processor(config, NUM_ROWS, postprocess, wait_for_min_actors_s=120)
    assert [row["id"] for row in rows] == list(range(NUM_ROWS))
    assert {row["id"]: list(row["tokens"]) for row in rows} == reference
    assert {row["reason"] for row in rows} == {"length"} and {row["n_out"] for row in rows} == {GREEDY["max_tokens"]}
    assert all(isinstance(row["text"], str) and row["n_in"] > 0 and 0 < row["ttft"] < row["took"] for row in rows)
    # Both replicas ran (whether both held a batch at the same executor step depends on the machine's load).
    assert max(running for running, _, _ in PoolSizes.seen) == 2, PoolSizes.seen
    replica_nodes = [actor["Address"]["NodeID"] for actor_id, actor in actors().items()
                     if actor_id not in earlier_actors and "EngineStageUDF" in actor["ActorClassName"]]
    assert sorted(replica_nodes) == sorted(node.node_id for node in two_nodes.list_all_nodes())


def test_autoscaling_pool_grows_under_load_and_shrinks_after(two_nodes: Cluster, llama_path: Path,
                                                             reference: dict[int, list[int]]) -> None:
    """concurrency=(1, 2): one replica, then a second asked for once Ray Data has queued 2 x max_concurrent_batches
    batches on the first (it may still be starting when the rows run out), then one given back as the inputs are
    consumed."""
    config = EngineProcessorConfig(model_source=str(llama_path), engine_kwargs=ENGINE, concurrency=(1, 2),
                                   batch_size=8, max_concurrent_batches=2, placement_group_config=ONE_PER_NODE)
    rows = run_processor(config, 64)
    assert {row["id"]: list(row["generated_tokens"]) for row in rows} == {i: reference[i] for i in range(64)}
    sizes = [running + pending for running, pending, _ in PoolSizes.seen]
    assert sizes[0] == 1 and 2 in sizes, PoolSizes.seen
    assert min(sizes[sizes.index(2):]) < 2, PoolSizes.seen
