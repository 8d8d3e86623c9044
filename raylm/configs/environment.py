"""EnvironmentFacts: what resolution needs to know of the machine and the Ray cluster, as data. They are gathered by
one small function on the engine's floor (cluster/engine/environment.py), which can see devices, Ray and the
runner's kernels; configs/resolve.py decides from them without any I/O, so a test can hand it any machine."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from raylm.configs.bundles import Bundle


@dataclass(frozen=True)
class EnvironmentFacts:
    cuda_devices: int = 0  # GPUs this process sees
    cuda_capability: tuple[int, int] = (0, 0)  # compute capability of this process's first GPU; (0, 0): none seen
    cpu_count: int = 1  # cores of this machine (a local Ray started here declares at least these)
    ray_connected: bool = False  # this process is in a Ray cluster (a Serve replica, a job, RAY_ADDRESS)
    # The connected cluster's nodes (with those its autoscaler may add); empty when not connected.
    ray_nodes: tuple[Bundle, ...] = ()
    # Attention kernels ("flash_attn", "triton", "cpu") that cannot run here -> why; those absent can.
    missing_kernels: Mapping[str, str] = field(default_factory=dict)
    # This CPU's bfloat16 dot-product instructions by name, "" where none (model_info.cpu_bf16_instructions).
    cpu_bf16_instructions: str = ""
    triton_interpret: bool = False  # TRITON_INTERPRET=1: triton kernels run on CPU tensors (tests)
    installed_packages: frozenset[str] = frozenset()  # optional packages among those resolution asks about
    architectures: tuple[str, ...] = ()  # model classes raylm has (runner/models/registry.py)

    @property
    def cluster_gpus(self) -> float:
        return sum(node.get("GPU", 0.0) for node in self.ray_nodes)

    def nodes_for(self, num_ray_bundles: int) -> list[Bundle]:
        """The nodes workers are placed on: the connected cluster's, else the one-node Ray that the executor starts
        on this machine (initialize_ray_cluster: a CPU per bundle at least, and this process's GPUs)."""
        if self.ray_nodes:
            return [dict(node) for node in self.ray_nodes]
        return [{"CPU": float(max(self.cpu_count, num_ray_bundles)), "GPU": float(self.cuda_devices)}]
