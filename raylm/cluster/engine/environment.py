"""gather_environment: the EnvironmentFacts resolution decides from (configs/environment.py), read where the engine
runs: the GPUs this process sees, the Ray cluster it is in and what that holds, the attention kernels and optional
packages that import here, the models raylm has. It starts nothing: a Ray cluster named by RAY_ADDRESS is joined to
read its nodes; none is started (the executor or DP client starts a local one when it places workers)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from raylm.configs import EngineConfig
from raylm.configs.environment import EnvironmentFacts
from raylm.configs.model_info import cpu_bf16_instructions
from raylm.configs.resolve import decide_device
from raylm.configs.resolve_sections import GRAMMAR_PACKAGES
from raylm.executor.ray_cluster import cluster_nodes, join_ray_cluster, ray_reachable
from raylm.runner.attention import missing_kernels, triton_interpret
from raylm.runner.models.registry import SUPPORTED_ARCHITECTURES


def gather_environment(config: EngineConfig, kernels: bool = True) -> EnvironmentFacts:
    """The facts for `config`'s resolution. `kernels` False: devices and Ray only (the Serve builder, which decides a
    replica's resources and no kernel)."""
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    connected = ray_reachable()
    if connected:
        join_ray_cluster()
    facts = EnvironmentFacts(
        cuda_devices=cuda_devices,
        cuda_capability=torch.cuda.get_device_capability(0) if cuda_devices else (0, 0),
        cpu_count=os.cpu_count() or 1,
        ray_connected=connected,
        ray_nodes=tuple(cluster_nodes()) if connected else (),
        cpu_bf16_instructions=cpu_bf16_instructions(),
        triton_interpret=triton_interpret(),
        installed_packages=frozenset(name for name in GRAMMAR_PACKAGES.values()
                                     if importlib.util.find_spec(name) is not None),
        architectures=SUPPORTED_ARCHITECTURES,
    )
    if not kernels:
        return facts
    # Only the kernels of the device resolution will pick are worth trying.
    devices = {decide_device(config, facts)}
    if config.compilation_config.custom_ops == "none":  # raylm's CPU kernels are off: not even built
        return dataclasses.replace(facts, missing_kernels={
            **missing_kernels(devices - {"cpu"}), "cpu": "custom_ops='none' turns raylm's CPU kernels off"})
    return dataclasses.replace(facts, missing_kernels=missing_kernels(devices))
