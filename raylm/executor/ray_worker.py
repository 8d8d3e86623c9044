"""RayWorkerWrapper: the body of one Worker actor.

The executor creates the actor in its placement-group bundle; then rank 0 opens the torch.distributed store
(`create_store`), every rank builds its Worker (`init_worker`), and each serves the control channel (`run`) until the
executor says stop. `run` lasts the actor's whole working life, so the executor's health monitor `ray.wait`s on it:
it ends only when the worker stops or dies.
"""
from __future__ import annotations

import os
import traceback

import ray
from ray import cloudpickle
from torch.distributed import TCPStore

from raylm.common.parallel_layout import DataParallelInfo
from raylm.configs import EngineConfig
from raylm.executor.channel import WorkerChannel
from raylm.executor.cluster_resources import process_cores
from raylm.worker.worker import Worker


def cuda_device_index(ray_gpu_id: str, visible_devices: str | None) -> int:
    """The CUDA index, in this process, of the GPU Ray assigned. Ray names a GPU by its node-level id; the process
    sees the GPUs listed in CUDA_VISIBLE_DEVICES (every GPU when it is unset), numbered from 0 in that order."""
    if visible_devices is None:
        return int(ray_gpu_id)
    visible = [device.strip() for device in visible_devices.split(",")]
    if ray_gpu_id not in visible:
        raise RuntimeError(f"Ray assigned GPU {ray_gpu_id}, but CUDA_VISIBLE_DEVICES={visible_devices!r} hides it")
    return visible.index(ray_gpu_id)


class RayWorkerWrapper:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Worker | None = None
        self._store: TCPStore | None = None

    def create_store(self, host: str) -> int:
        """Rank 0: start the torch.distributed store on a free port of this node and return the port. The store is
        multi-tenant, so this rank's init_process_group joins it instead of binding the port a second time."""
        assert self.rank == 0, "rank 0 hosts the rendezvous store"
        self._store = TCPStore(host, 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        return self._store.port

    def init_worker(self, config: EngineConfig, distributed_init_method: str,
                    num_local_workers: int, data_parallel: DataParallelInfo) -> None:
        """Build the Worker on the device Ray assigned, join the process groups and load the model."""
        local_rank, num_threads = 0, None
        if config.resolved.device == "cuda":
            gpu_ids = ray.get_runtime_context().get_accelerator_ids()["GPU"]
            assert len(gpu_ids) == 1, f"a worker owns one GPU; Ray assigned {gpu_ids}"
            local_rank = cuda_device_index(gpu_ids[0], os.environ.get("CUDA_VISIBLE_DEVICES"))
        else:
            num_threads = max(1, process_cores() // num_local_workers)
        self.worker = Worker(config, self.rank, local_rank, distributed_init_method, num_threads,
                             data_parallel)
        self.worker.init_device()
        self.worker.load_model()

    def run(self, address: tuple[str, int], token: str) -> None:
        """Serve the executor's requests in order until it sends None. A request is (seq, method, args, kwargs,
        reply_ranks): the ranks in reply_ranks answer (seq, True, result), and any rank that fails answers
        (seq, False, traceback). `method` is a Worker method name or a cloudpickled function."""
        assert self.worker is not None, "init_worker first"
        channel = WorkerChannel(address, self.rank, token)
        try:
            while (request := channel.recv()) is not None:
                seq, method, args, kwargs, reply_ranks = request
                try:
                    result = self.worker.execute_method(
                        cloudpickle.loads(method) if isinstance(method, bytes) else method, *args, **kwargs)
                except Exception:
                    channel.send((seq, False, traceback.format_exc()))
                    continue
                if self.rank in reply_ranks:
                    channel.send((seq, True, result))
        except ConnectionError:
            pass  # the executor closed its end: nobody is left to serve
        finally:
            channel.close()
