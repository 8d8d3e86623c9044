"""Three Ray nodes of 2 CPUs on this machine (ray.cluster_utils.Cluster): TP=2 x PP=2 places each TP group on one
node (the engine's bundle used to take a worker's place and split a group), and runs token for token like one
device."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from raylm.cluster import LLM, SamplingParams
from raylm.configs import ParallelConfig
from raylm.configs.bundles import engine_bundles
from raylm.executor.cluster_resources import ClusterCapacity
from raylm.executor.placement import bundle_node_ids, create_placement_plan

TP2_PP2 = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 250, 3]}, {"prompt_token_ids": list(range(40, 70))}]


@pytest.fixture(scope="module")
def three_nodes() -> Iterator[Cluster]:
    if ray.is_initialized():  # a local Ray that an earlier test's engine started for itself
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_tp_groups_stay_inside_nodes(three_nodes: Cluster) -> None:
    plan = create_placement_plan(TP2_PP2, engine_bundles(TP2_PP2, "cpu", ClusterCapacity.current().nodes))
    try:
        specs = plan.placement_group.bundle_specs
        assert [spec["CPU"] for spec in specs] == [1.0, 2.0, 2.0]  # the engine's, then one bundle per TP group
        assert plan.node_ids[0] == plan.node_ids[1] and plan.node_ids[2] == plan.node_ids[3]
        # Every node holds one bundle. (The engine's bundle is pinned to its node's `node:<ip>` resource, which all
        # three share here, so it may sit on another node than the driver.)
        assert len(set(bundle_node_ids(plan.placement_group).values())) == 3
    finally:
        ray.util.remove_placement_group(plan.placement_group)


@pytest.mark.slow
def test_tp2_pp2_across_nodes_matches_one_device(three_nodes: Cluster, llama_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = LLM(model=str(llama_path), max_model_len=128)
    expected = [out.outputs[0].token_ids for out in reference.generate(PROMPTS, params, use_tqdm=False)]
    reference.shutdown()
    llm = LLM(model=str(llama_path), tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=128)
    try:
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    finally:
        llm.shutdown()
    layout = next(line for line in caplog.text.splitlines() if "placement (TP=2 x PP=2" in line)
    assert all(f"rank {rank} -> " in layout for rank in range(4))
    assert "span nodes" not in caplog.text
