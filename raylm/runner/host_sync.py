"""Where a step may read device values on the host, and how values cross between host and device without stalling.

A decode step on CUDA has one host wait: the sampled tokens (and their logprobs) read back at its end, waited for on
an event (`to_host`). Everything before it (forward, sampler) reads nothing back, so it can be captured in a CUDA
graph and the host runs ahead of the device. On CPU a host read costs nothing, and some layers keep faster paths
that read values (numpy's argmax, a row subset chosen with nonzero): `host_reads_are_free` says when they may.
Under torch.compile it says no, so a CPU test that compiles a path with `fullgraph=True` traces exactly what CUDA
runs (tests/host_reads.py fails such a trace on any value read to the host).
"""
from __future__ import annotations

import torch


def host_reads_are_free(t: torch.Tensor) -> bool:
    """Whether code may read `t`'s values on the host at no cost: on CPU, outside torch.compile. False on CUDA,
    where it would wait for the device (and break a graph capture)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device` without a host wait: on CUDA copied from pinned memory with non_blocking (a plain
    `.to(device)` waits for the copy: a stream sync)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of device tensors: copied into pinned memory without blocking, then one wait on an event recorded
    after the copies (the step's one host wait; not a stream synchronize, which sync-debug mode reports)."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return copies
