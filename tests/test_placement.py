"""Placement before any worker starts: the bundles an engine asks for, the ranks they get, and the checks that fail
fast when a Ray cluster can never hold them (or time out when it stays full), for the executor, DP and Serve."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from raylm.cluster import LLM
from raylm.cluster.serve.app import build_openai_app, llm_server_options, replica_deployment
from raylm.configs import ParallelConfig, make_engine_config
from raylm.configs.bundles import EngineBundles, engine_bundles
from raylm.executor.cluster_resources import ClusterCapacity, check_fits
from raylm.executor.placement import assign_ranks, create_placement_plan, describe_engine

TP2_PP2 = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
ONE_WORKER = ParallelConfig(distributed_executor_backend="ray")
ONE_WORKER_LAYOUT = EngineBundles({"CPU": 1.0}, ({"CPU": 1.0},))
NEEDS = (r"it needs 5 bundles for TP=2 x PP=2 = 4 workers and the engine itself: the engine's bundle \{CPU: 1\} \+ "
         r"4 worker bundles \{CPU: 1\}, \{CPU: 5\} in all")


def two_cpus(nodes: int = 1) -> ClusterCapacity:
    return ClusterCapacity([{"CPU": 2.0}] * nodes, {"CPU": 2.0 * nodes})


# ---- pure: bundles, ranks, messages ----------------------------------------------------------------


def test_one_bundle_per_tp_group_when_the_nodes_hold_them() -> None:
    grouped = engine_bundles(TP2_PP2, "cpu", two_cpus(nodes=3).nodes)
    assert grouped.bundles == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}] and grouped.workers_per_bundle == 2
    assert "+ 2 bundles {CPU: 2} of one TP group (2 workers) each" in grouped.describe()
    # Nodes of one GPU each cannot hold a TP group: one bundle per device, and the groups must straddle nodes.
    gpus = ClusterCapacity([{"CPU": 8.0, "GPU": 1.0}] * 4, {"CPU": 32.0, "GPU": 4.0})
    assert engine_bundles(TP2_PP2, "cuda", gpus.nodes).bundles == [{"CPU": 1.0}] + [{"GPU": 1.0}] * 4
    # One node of 3 CPUs and three of 1 hold one engine of TP=2 grouped; two DP engines only one bundle per device.
    uneven = ClusterCapacity([{"CPU": 3.0}] + [{"CPU": 1.0}] * 3, {"CPU": 6.0})
    tp2 = ParallelConfig(tensor_parallel_size=2)
    assert engine_bundles(tp2, "cpu", uneven.nodes).workers_per_bundle == 2
    assert engine_bundles(tp2, "cpu", uneven.nodes, num_engines=2).workers_per_bundle == 1


def test_ranks_take_whole_tp_groups_first() -> None:
    # One bundle per TP group: each group is one bundle, so one node.
    assert assign_ranks({1: "b", 2: "c"}, 2, 2, "a") == [1, 1, 2, 2]
    # One per device, 1 + 2 + 1 over three nodes (the engine's node holds one): the pair on node b is a whole group.
    assert assign_ranks({1: "engine", 2: "b", 3: "b", 4: "c"}, 1, 2, "engine") == [2, 3, 1, 4]
    assert assign_ranks({1: "engine", 2: "b", 3: "engine", 4: "b"}, 1, 2, "engine") == [1, 3, 2, 4]


def test_never_fitting_bundles_name_what_is_missing() -> None:
    layout = engine_bundles(TP2_PP2, "cpu", two_cpus().nodes)
    with pytest.raises(ValueError, match=NEEDS + r"; CPU: 5 needed, the cluster has 2\. Lower tensor_parallel_size"):
        check_fits(layout.bundles, "PACK", describe_engine(layout, TP2_PP2), two_cpus())
    gpus = ClusterCapacity([{"CPU": 8.0, "GPU": 1.0}] * 2, {"CPU": 16.0, "GPU": 2.0})
    with pytest.raises(ValueError, match=r"no node can hold \{GPU: 2\} \(the largest has \{GPU: 1\}\)"):
        check_fits([{"CPU": 1.0}, {"GPU": 2.0}], "PACK", "a TP group", gpus)
    with pytest.raises(ValueError, match="STRICT_PACK puts them all on one node"):
        check_fits([{"CPU": 1.0}, {"CPU": 2.0}], "STRICT_PACK", "two bundles", two_cpus(nodes=2))
    pinned = ClusterCapacity([{"CPU": 0.0, "node:10.0.0.1": 1.0}, {"CPU": 4.0}], {"CPU": 4.0, "node:10.0.0.1": 1.0})
    with pytest.raises(ValueError, match=r"must be on the engine's node \(node:10.0.0.1\), which has \{CPU: 0\}"):
        check_fits([{"CPU": 1.0, "node:10.0.0.1": 0.001}, {"CPU": 1.0}], "PACK", "pinned", pinned)
    check_fits(EngineBundles({"CPU": 1.0}, [{"CPU": 2.0}] * 2, 2).bundles, "PACK", "fits", two_cpus(nodes=3))


# ---- a local Ray of 2 CPUs ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_cpu_ray() -> Iterator[None]:
    if ray.is_initialized():  # a local Ray that an earlier test's engine started for itself
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_engine_that_can_never_fit_fails_at_once(two_cpu_ray: None, llama_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=NEEDS + r".*CPU: 5 needed, the cluster has 2"):
        LLM(model=str(llama_path), tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=128)
    assert time.monotonic() - start < 20
    assert_no_placement_groups()


def test_serve_app_checks_the_fit_when_built(two_cpu_ray: None, llama_path: Path) -> None:
    with pytest.raises(ValueError, match=NEEDS + r".*CPU: 5 needed, the cluster has 2"):
        build_openai_app(make_engine_config(model=str(llama_path), tensor_parallel_size=2, pipeline_parallel_size=2))
    # One worker fits beside its replica: Serve creates the replica in a group of both bundles.
    config = make_engine_config(model=str(llama_path), distributed_executor_backend="ray")
    options = llm_server_options(config, replica_deployment(config))
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert (options["ray_actor_options"]["num_cpus"], options["ray_actor_options"]["num_gpus"]) == (1, 0)  # bundle 0


def test_engine_that_could_fit_later_times_out(two_cpu_ray: None, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = ray.util.placement_group([{"CPU": 2.0}])  # the engine and its worker need both CPUs
    ray.get(holder.ready())
    monkeypatch.setenv("RAYLM_PLACEMENT_GROUP_TIMEOUT_S", "2")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not ready after 2 s: it needs 2 bundles .*the engine's bundle \{CPU: 1\} "
                                           r"\+ 1 worker bundle \{CPU: 1\}, \{CPU: 2\} in all, and the cluster has "
                                           r"\{CPU: 0\} free.*RAYLM_PLACEMENT_GROUP_TIMEOUT_S=2 s"):
        create_placement_plan(ONE_WORKER, ONE_WORKER_LAYOUT)
    assert time.monotonic() - start < 10
    ray.util.remove_placement_group(holder)
    assert_no_placement_groups()
    monkeypatch.setenv("RAYLM_PLACEMENT_GROUP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="RAYLM_PLACEMENT_GROUP_TIMEOUT_S must be a number of seconds > 0"):
        create_placement_plan(ONE_WORKER, ONE_WORKER_LAYOUT)
    assert_no_placement_groups()


def assert_no_placement_groups() -> None:
    deadline = time.monotonic() + 10
    while any(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values()):
        assert time.monotonic() < deadline, ray.util.placement_group_table()
        time.sleep(0.1)
