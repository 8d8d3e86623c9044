"""Structured output in the engine: grammars compiled off the step loop, one matcher per request, the step's token
bitmask (vLLM v1's StructuredOutputManager)."""
from raylm.cluster.core.structured_output.manager import StructuredOutputManager
from raylm.cluster.core.structured_output.validation import validate_structured_outputs

__all__ = ["StructuredOutputManager", "validate_structured_outputs"]
