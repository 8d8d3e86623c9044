"""DPEngineCoreClient: `data_parallel_size` engines, each a Ray actor, behind the calls of a single EngineCore.

Each engine gets a placement group of its own (its bundle and its workers'). A new request goes to the engine with the
lowest `4 * waiting + running` (DPLoadBalancer), or, under routing_policy "prefix", to the engine likeliest to hold
its prompt's prefix while the loads are close (PrefixAwareLoadBalancer); its outputs come back over that engine's
connection, and an abort goes to the engine that holds the request. Engines of a dense model (or of a MoE model
without expert parallel) are independent, each in its own torch.distributed world. MoE engines with expert parallel
share one world (global rank = dp * PP * TP + pp * TP + tp) and step in lock-step (see cluster/dp/engine_core_actor.py);
the client relays the start of each wave.

A dead engine fails its own requests with an error naming it (DPEngineDiedError from step) within about a second;
independent engines keep serving the rest, while lock-step engines cannot go on without it.
"""
from __future__ import annotations

import itertools
import pickle
import select
import time
import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.core.request import Request
from raylm.cluster.dp.dp_load_balancer import DPLoadBalancer
from raylm.cluster.dp.engine_core_actor import EngineCoreActor, EngineCoreOutputs
from raylm.cluster.dp.prefix_router import make_dp_balancer
from raylm.cluster.engine.outputs import DPEngineDiedError
from raylm.cluster.engine.stats import SchedulerStats
from raylm.common.parallel_layout import NO_DATA_PARALLEL, DataParallelInfo
from raylm.configs import EngineConfig
from raylm.executor.channel import DriverChannel, recv_frame, send_frame
from raylm.executor.placement import bundle_node_ids, reserve_dp_placement_groups
from raylm.executor.ray_cluster import initialize_ray_cluster
from raylm.executor.ray_executor import death_cause, get_all

_EngineActor = ray.remote(EngineCoreActor)
_CONNECT_TIMEOUT_S = 120.0
_POLL_S = 0.05  # step() waits at most this long for outputs, so its caller can take in new requests
_DEATH_CAUSE_WAIT_S = 2.0
_LOCALHOST = "127.0.0.1"


class DPEngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        resolved = config.resolved
        initialize_ray_cluster(resolved.num_ray_bundles)
        parallel = config.parallel_config
        self.num_engines = parallel.data_parallel_size
        self.lockstep = resolved.dp_lockstep
        self.config = config
        device = resolved.device
        in_process_worker = resolved.executor_backend == "uni"
        self.placement_groups = reserve_dp_placement_groups(parallel, resolved.bundle_layout)
        self.actors: list[ray.actor.ActorHandle] = []
        self.names: list[str] = []
        self.run_refs: list[ray.ObjectRef] = []
        self.sockets: list[Any] = []
        self.balancer = DPLoadBalancer(self.num_engines)
        self.request_engine: dict[str, int] = {}  # unfinished request id -> its engine
        self.stats = [SchedulerStats() for _ in range(self.num_engines)]
        self._dead: dict[int, str] = {}  # engine -> why
        self._outbox: list[list[tuple]] = [[] for _ in range(self.num_engines)]
        self._buffered: list[EngineCoreOutput] = []
        self._lost: list[DPEngineDiedError] = []
        self._call_ids = itertools.count()
        self._call_results: dict[int, dict[int, tuple[bool, Any]]] = {}
        self._closed = False
        try:
            self._start_engines(device, in_process_worker)
        except BaseException:
            self.shutdown()
            raise

    def _start_engines(self, device: str, in_process_worker: bool) -> None:
        node_ids = [bundle_node_ids(group)[0] for group in self.placement_groups]
        node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        engine_id = uuid.uuid4().hex[:8]
        for rank, group in enumerate(self.placement_groups):
            name = f"raylm-{engine_id}-dp{rank}"
            self.actors.append(_EngineActor.options(  # type: ignore[arg-type]  # Ray: ActorHandle | the class
                name=name, num_cpus=0, num_gpus=1 if in_process_worker and device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote(rank))
            self.names.append(f"DP engine {rank} (actor {name} on {node_ips[node_ids[rank]]})")
        one_node = len(set(node_ids)) == 1
        data_parallel = [NO_DATA_PARALLEL] * self.num_engines
        if self.lockstep:
            host = _LOCALHOST if one_node else node_ips[node_ids[0]]
            port = ray.get(self.actors[0].create_store.remote(host))
            data_parallel = [DataParallelInfo(rank, self.num_engines, f"tcp://{host}:{port}")
                             for rank in range(self.num_engines)]
        threads: list[int | None] = [None] * self.num_engines
        if in_process_worker and device == "cpu":  # the engines' workers share their node's cores
            cores = ray.get([actor.num_cores.remote() for actor in self.actors])
            threads = [max(1, cores[rank] // node_ids.count(node_ids[rank])) for rank in range(self.num_engines)]
        config_ref = ray.put(self.config)
        init_refs = [actor.init_engine.remote(config_ref, data_parallel[rank], threads[rank])
                     for rank, actor in enumerate(self.actors)]
        get_all(init_refs)
        num_blocks = ray.get(init_refs)
        # By load, or by cached prefix within a load threshold (routing_policy); the engines' pools bound the latter.
        self.balancer = make_dp_balancer(self.config.resolved.routing_policy, self.config.routing_config, num_blocks,
                                         self.config.cache_config.block_size)

        this_node = ray.get_runtime_context().get_node_id()
        channel = DriverChannel(_LOCALHOST if set(node_ids) == {this_node} else node_ips[this_node],
                                self.num_engines)
        self.run_refs = [actor.run.remote(channel.address, channel.token) for actor in self.actors]
        channel.accept(_CONNECT_TIMEOUT_S, still_starting=lambda: not ray.wait(self.run_refs, timeout=0)[0])
        self.sockets = channel.sockets

    # ---- the EngineCore calls ------------------------------------------------------------------

    def add_request(self, request: Request) -> int:
        """Queue a request on the least loaded engine (sent with the next step); returns that engine's index."""
        self._raise_if_fatal()
        index = self.balancer.choose(request.prompt_token_ids)
        self._outbox[index].append(("add", request))
        self.request_engine[request.request_id] = index
        return index

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            index = self.request_engine.pop(request_id, None)
            if index is not None and index not in self._dead:
                self._outbox[index].append(("abort", request_id))

    def step(self) -> list[EngineCoreOutput]:
        """The outputs that arrived since the last call, waiting up to _POLL_S for some while requests run."""
        self._flush()
        if not self._buffered and not self._lost and self.request_engine:
            self._pump(_POLL_S)
        if self._lost:
            raise self._lost.pop(0)
        outputs, self._buffered = self._buffered, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_engine or self._buffered or self._lost)

    def engine_stats(self) -> list[SchedulerStats]:
        return list(self.stats)

    def check_health(self) -> None:
        if self._dead:
            raise RuntimeError("; ".join(self._dead.values()))
        self._call_all("check_health")

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """A Worker method on every worker of every engine; results in global rank order."""
        return [result for results in self._call_all("collective_rpc", method, args) for result in results]

    def drain_trace(self) -> list[dict[str, Any]]:
        """Every engine's timeline events (each numbers its own trace processes apart)."""
        return [event for events in self._call_all("drain_trace") for event in events]

    def reset_prefix_cache(self) -> bool:
        return all(self._call_all("reset_prefix_cache"))

    def sleep(self, level: int = 1) -> None:
        self._call_all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call_all("wake_up", tags)

    def is_sleeping(self) -> bool:
        return any(self._call_all("is_sleeping"))

    def shutdown(self) -> None:
        """Stop the engines (they stop their workers) and release the placement groups; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for index, sock in enumerate(self.sockets):
            if index not in self._dead:
                try:
                    send_frame(sock, pickle.dumps(None))
                except OSError:
                    pass  # already gone
        if self.run_refs:
            ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=10.0)
        for sock in self.sockets:
            sock.close()
        for actor in self.actors:
            ray.kill(actor)
        for group in self.placement_groups:
            ray.util.remove_placement_group(group)

    # ---- internals -----------------------------------------------------------------------------

    def _flush(self) -> None:
        """Send the queued adds and aborts, one frame per engine and kind."""
        for index, messages in enumerate(self._outbox):
            if not messages:
                continue
            self._outbox[index] = []
            adds = [request for kind, request in messages if kind == "add"]
            aborts = [request_id for kind, request_id in messages if kind == "abort"]
            frames = ([("add", adds)] if adds else []) + ([("abort", aborts)] if aborts else [])
            self._send(index, *frames)

    def _send(self, index: int, *messages: tuple) -> None:
        try:
            for message in messages:
                send_frame(self.sockets[index], pickle.dumps(message, protocol=5))
        except OSError:
            self._on_death(index)

    def _pump(self, timeout: float) -> None:
        live = {self.sockets[i]: i for i in range(self.num_engines) if i not in self._dead}
        if not live:
            return
        readable, _, _ = select.select(list(live), [], [], timeout)
        for sock in readable:
            index = live[sock]
            try:
                message: EngineCoreOutputs = pickle.loads(recv_frame(sock))
            except (OSError, EOFError):
                self._on_death(index)
                continue
            self._on_message(index, message)

    def _on_message(self, index: int, message: EngineCoreOutputs) -> None:
        if message.call_result is not None:
            call_id, ok, value = message.call_result
            self._call_results.setdefault(call_id, {})[index] = (ok, value)
            return
        if message.wave_started is not None:
            for other in range(self.num_engines):
                if other != index and other not in self._dead:
                    self._send(other, ("wave", message.wave_started))
            return
        self.stats[index] = message.scheduler_stats
        self.balancer.on_report(index, message.scheduler_stats.num_waiting_reqs,
                                message.scheduler_stats.num_running_reqs, message.num_received)
        for output in message.outputs:
            if output.finish_reason is not None:
                self.request_engine.pop(output.request_id, None)
        self._buffered.extend(message.outputs)

    def _on_death(self, index: int) -> None:
        if index in self._dead:
            return
        done, _ = ray.wait([self.run_refs[index]], timeout=_DEATH_CAUSE_WAIT_S)
        reason = f"{self.names[index]} died: {death_cause(done[0]) if done else 'its connection closed'}"
        self._dead[index] = reason
        self.balancer.mark_dead(index)
        lost = [request_id for request_id, engine in self.request_engine.items() if engine == index]
        for request_id in lost:
            del self.request_engine[request_id]
        fatal = self.lockstep or len(self._dead) == self.num_engines
        if fatal:
            reason += (" (lock-step expert-parallel engines cannot go on without it)" if self.lockstep
                       else " (no engine is left)")
        self._lost.append(DPEngineDiedError(reason, lost, fatal))

    def _raise_if_fatal(self) -> None:
        if (self.lockstep and self._dead) or len(self._dead) == self.num_engines:
            raise RuntimeError("; ".join(self._dead.values()))

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Call an EngineCore method on every live engine; results in engine order."""
        self._raise_if_fatal()
        self._flush()
        call_id = next(self._call_ids)
        targets = [i for i in range(self.num_engines) if i not in self._dead]
        for index in targets:
            self._send(index, ("call", call_id, method, args))
        results = self._call_results.setdefault(call_id, {})
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while any(i not in results and i not in self._dead for i in targets):
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines did not answer {method} within {_CONNECT_TIMEOUT_S:.0f} s")
            self._pump(_POLL_S)
        del self._call_results[call_id]
        for index in targets:
            if index in self._dead:
                raise RuntimeError(self._dead[index])
            ok, value = results[index]
            if not ok:
                raise RuntimeError(f"{self.names[index]} failed in {method}:\n{value}")
        return [results[index][1] for index in targets]

