"""The frontend's check of a constrained request, before it reaches an engine: pick the backend (auto: xgrammar,
else guidance where xgrammar cannot enforce the constraint, as vLLM does) or refuse with what is unsupported."""
from __future__ import annotations

from raylm.cluster.structured_output.backend_guidance import GuidanceBackend
from raylm.cluster.structured_output.backend_xgrammar import XgrammarBackend
from raylm.common.structured_outputs import StructuredOutputsParams

# Without a tokenizer the backends only parse and check: cheap, no state.
_CHECKERS = {"xgrammar": XgrammarBackend(), "guidance": GuidanceBackend()}


def validate_structured_outputs(params: StructuredOutputsParams, backend: str) -> str:
    """The backend that will compile `params` (also stored in it); ValueError "<kind>: ..." when none can."""
    if params._backend is not None:
        return params._backend
    candidates = ["xgrammar", "guidance"] if backend == "auto" else [backend]
    errors = []
    for name in candidates:
        try:
            _CHECKERS[name].check(params)
        except ValueError as err:
            errors.append(str(err))
            continue
        params._backend = name
        return name
    raise ValueError(" / ".join(errors))
