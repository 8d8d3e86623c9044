"""torch.compile(fullgraph=True) as a CPU check that a code path reads no device value on the host.

A graph break fails a fullgraph compile, but since torch 2.5 a fullgraph trace captures `.item()`, `int(t)`, boolean
mask indexing, nonzero, bincount and the like as "unbacked" symbols instead of breaking, and traces numpy code on a
tensor as torch ops: on CUDA each is still a host wait. So the backend below also fails the compile when a value in
the traced graph depends on such a symbol, or a node copies to the host (`.cpu()`, `.numpy()`, numpy functions). What
it cannot see: a sync inside one opaque op; the GPU check's sync-debug mode (scripts/gpu_check.py) covers those.

Under torch.compile `raylm.runner.host_sync.host_reads_are_free` is False, so the CPU traces the path CUDA runs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import utils as dynamo_utils
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

# What the error says; torch wraps it (BackendCompilerFailed), so tests match on the text.
HOST_READ = "values read back to the host"


_HOST_METHODS = {"cpu", "numpy", "tolist", "item"}
_NUMPY_WRAPPERS = (dynamo_utils.numpy_to_tensor_wrapper, dynamo_utils.numpy_method_wrapper,
                   dynamo_utils.numpy_operator_wrapper)


class HostReadError(RuntimeError):
    pass


def _reads_host(node: torch.fx.Node) -> bool:
    if free_unbacked_symbols(node.meta.get("example_value")):
        return True
    if node.op == "call_method":
        return node.target in _HOST_METHODS
    return node.op == "call_function" and isinstance(node.target, _NUMPY_WRAPPERS)


class NoHostReadsBackend:
    """A torch.compile backend that runs the traced graph eagerly after checking it has no data-dependent value;
    counts the graphs it was given, so a test can tell the compiled path really ran."""

    def __init__(self) -> None:
        self.num_graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        reads = [node.format_node() for node in gm.graph.nodes if _reads_host(node)]
        if reads:
            raise HostReadError(f"{HOST_READ} (a sync on CUDA):\n  " + "\n  ".join(reads[:8]))
        self.num_graphs += 1
        return gm.forward


def compile_without_host_reads(fn: Callable[..., Any]) -> tuple[Callable[..., Any], NoHostReadsBackend]:
    """`fn` compiled with fullgraph=True (any graph break raises) and the checking backend (any host read raises),
    after a reset so that no earlier compile is reused."""
    torch._dynamo.reset()
    backend = NoHostReadsBackend()
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend), backend
