"""The frontend's check of a constrained request, before it reaches an engine: pick the first of the resolved
backends that can enforce it (auto: xgrammar, else guidance, as vLLM does) or refuse with what is unsupported."""
from __future__ import annotations

from raylm.cluster.core.structured_output.backend_guidance import GuidanceBackend
from raylm.cluster.core.structured_output.backend_xgrammar import XgrammarBackend
from raylm.common.structured_outputs import StructuredOutputsParams

# Without a tokenizer the backends only parse and check: cheap, no state.
_CHECKERS = {"xgrammar": XgrammarBackend(), "guidance": GuidanceBackend()}


def validate_structured_outputs(params: StructuredOutputsParams, backends: tuple[str, ...]) -> str:
    """The first of `backends` (the resolved config's structured_outputs_backends, or the one a request named) that
    can compile `params` (also stored in it), only the first with disable_fallback; ValueError "<kind>: ..." when
    none can."""
    if params._backend is not None:
        return params._backend
    if not backends:
        raise ValueError(f"{params.kind}: this engine enforces no output constraints (its config was resolved "
                         f"without grammar backends)")
    errors = []
    for name in backends[:1] if params.disable_fallback else backends:
        try:
            _CHECKERS[name].check(params)
        except ValueError as err:
            errors.append(str(err))
            continue
        params._backend = name
        return name
    raise ValueError(" / ".join(errors))
