"""RayExecutor: one Worker actor per device, in one placement group per engine.

Ray places, starts, watches and stops the workers; the steps themselves travel over the control channel
(executor/rpc.py): each SchedulerOutput is pickled once and broadcast, and only the output rank (the first TP rank of
the last PP stage) answers. A monitor thread `ray.wait`s on every worker's long-running `run` call, so a dead worker
fails the pending and later calls within about a second instead of leaving the engine waiting.
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray import cloudpickle
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.common.outputs import GrammarOutput, SchedulerOutput
from raylm.common.parallel_layout import RankLayout
from raylm.executor.abstract import Executor
from raylm.executor.channel import DriverChannel
from raylm.executor.placement import PlacementPlan, create_placement_plan
from raylm.executor.ray_cluster import initialize_ray_cluster
from raylm.executor.ray_worker import RayWorkerWrapper
from raylm.executor.rpc import RpcClient, RpcFuture

_CONNECT_TIMEOUT_S = 120.0
_MONITOR_INTERVAL_S = 1.0
_DEATH_GRACE_S = 1.0
_WorkerActor = ray.remote(RayWorkerWrapper)


class RayExecutor(Executor):
    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        self.layout = RankLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.output_rank = self.layout.output_rank()
        self.plan: PlacementPlan | None = None
        self.workers: list[ray.actor.ActorHandle] = []
        self.actor_names: list[str] = []
        self.worker_names: list[str] = []  # for error messages
        self.run_refs: list[ray.ObjectRef] = []
        self.rpc: RpcClient | None = None
        self._closing = threading.Event()
        self._monitor: threading.Thread | None = None
        resolved = self.config.resolved
        initialize_ray_cluster(resolved.num_ray_bundles)  # the executor places workers: it starts Ray if none runs
        try:
            self.plan = create_placement_plan(parallel, resolved.bundle_layout)
            self._start_workers(resolved.device)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, device: str) -> None:
        plan = self.plan
        assert plan is not None
        engine_id = uuid.uuid4().hex[:8]
        for rank, bundle in enumerate(plan.bundle_indices):
            _, pp, tp = self.layout.coords(rank)
            name = f"raylm-{engine_id}-rank{rank}"
            # Resources come from the bundle; num_cpus=0 keeps Ray from also counting CPUs per actor.
            self.workers.append(_WorkerActor.options(  # type: ignore[arg-type]  # Ray: ActorHandle | the class
                name=name, num_cpus=0, num_gpus=1 if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(plan.placement_group, bundle),
            ).remote(rank))
            self.actor_names.append(name)
            self.worker_names.append(f"rank {rank} (TP {tp}, PP {pp}; actor {name} on {plan.node_ips[rank]})")

        init_method = self.data_parallel.init_method  # lock-step DP engines share one rendezvous
        if init_method is None:
            host = plan.rendezvous_host
            init_method = f"tcp://{host}:{ray.get(self.workers[0].create_store.remote(host))}"
        config_ref = ray.put(self.config)  # resolved: the workers take its device, whatever their own node has
        get_all([worker.init_worker.remote(config_ref, init_method, plan.num_local_workers(rank), self.data_parallel)
                  for rank, worker in enumerate(self.workers)])

        channel = DriverChannel(plan.control_host, len(self.workers))
        self.run_refs = [worker.run.remote(channel.address, channel.token) for worker in self.workers]
        try:
            channel.accept(_CONNECT_TIMEOUT_S, still_starting=lambda: not ray.wait(self.run_refs, timeout=0)[0])
        except BaseException:
            channel.close()
            get_all(ray.wait(self.run_refs, timeout=0)[0])  # a worker's own error says more than the timeout
            raise
        # A peer's error is often the echo of a death that Ray reports a moment later: wait a little for it.
        self.rpc = RpcClient(channel, self.worker_names, lambda: self._find_dead_worker(timeout=_DEATH_GRACE_S))
        self._monitor = threading.Thread(target=self._monitor_workers, name="raylm-worker-monitor", daemon=True)
        self._monitor.start()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        payload = method if isinstance(method, str) else cloudpickle.dumps(method)
        return self._rpc().call(payload, args, kwargs, reply_ranks=tuple(range(len(self.workers)))).result()

    def execute_model(self, scheduler_output: SchedulerOutput) -> RpcFuture:
        return self._rpc().call("execute_model", (scheduler_output,), reply_ranks=(self.output_rank,), unwrap=True,
                                fatal=True)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> RpcFuture:
        return self._rpc().call("sample_tokens", (grammar_output,), reply_ranks=(self.output_rank,), unwrap=True,
                                fatal=True)

    def execute_dummy_batch(self) -> RpcFuture:
        return self._rpc().call("execute_dummy_batch", reply_ranks=(self.output_rank,), unwrap=True, fatal=True)

    def check_health(self) -> None:
        rpc = self._rpc()
        dead = self._find_dead_worker(timeout=0.0)
        if dead is not None:
            rpc.fail(dead)
        if rpc.failure is not None:
            raise RuntimeError(rpc.failure)

    def shutdown(self) -> None:
        """Stop the workers and release the placement group; safe to call more than once."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.rpc is not None:
            self.rpc.close()
        for worker in self.workers:
            try:
                ray.kill(worker)
            except RayError:
                pass  # already gone
        if self.plan is not None and self.plan.owned:
            ray.util.remove_placement_group(self.plan.placement_group)
        if self._monitor is not None:
            self._monitor.join(timeout=2 * _MONITOR_INTERVAL_S)

    def _rpc(self) -> RpcClient:
        assert self.rpc is not None, "the workers are not started"
        return self.rpc

    def _monitor_workers(self) -> None:
        try:
            while not self._closing.is_set():
                dead = self._find_dead_worker(timeout=_MONITOR_INTERVAL_S)
                if dead is not None:
                    self._rpc().fail(dead)
                    return
        except (RayError, SystemExit) as err:  # Ray itself went away (ray.shutdown raises SystemExit in ray.wait)
            if not self._closing.is_set():
                self._rpc().fail(f"RayExecutor: lost the Ray cluster while watching the workers: {err!r}")

    def _find_dead_worker(self, timeout: float) -> str | None:
        """Who stopped serving (looked for up to `timeout`), with Ray's word on why; None while all serve or when the
        executor is shutting them down."""
        done, _ = ray.wait(self.run_refs, num_returns=1, timeout=timeout)
        if not done or self._closing.is_set():
            return None
        rank = self.run_refs.index(done[0])
        return f"RayExecutor: worker {self.worker_names[rank]} died: {death_cause(done[0])}"


def death_cause(run_ref: ray.ObjectRef) -> str:
    """Ray's word on why an actor's long-running call ended."""
    try:
        ray.get(run_ref, timeout=0)
    except RayActorError as err:
        return str(err).strip().splitlines()[0]
    except RayError as err:
        return str(err).strip()
    return "its run loop returned"


def get_all(refs: list[ray.ObjectRef]) -> None:
    """Wait for every ref, raising the first error as soon as it is known (not after the slowest worker)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)
