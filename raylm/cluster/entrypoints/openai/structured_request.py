"""What a request constrains its output to, from whichever field says so (response_format, structured_outputs, the
guided_* aliases, or tools with tool_choice required / a named function) and vLLM's guided_whitespace_pattern and
guided_decoding_backend options, checked before it reaches the engine: a constraint no backend can enforce is a 400
that names the field and what is unsupported."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from raylm.cluster.core.structured_output import validate_structured_outputs
from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.forced_tool_calls import (
    NamedToolCallParser,
    RequiredToolCallParser,
    parameters_schema,
    required_schema,
)
from raylm.cluster.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from raylm.cluster.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from raylm.common.structured_outputs import StructuredOutputsParams
from raylm.configs import EngineConfig
from raylm.configs.structured_outputs_config import StructuredOutputsConfig

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class OutputConstraint:
    structured_outputs: StructuredOutputsParams | None = None
    param: str | None = None  # the request field it came from
    tool_parser: Callable[[], ToolParser] | None = None  # reads the output back as tool calls


def request_constraint(request: SamplingRequest, engine_config: EngineConfig) -> OutputConstraint:
    """The request's constraint, checked against the engine's (resolved) structured-output backends."""
    config = engine_config.structured_outputs_config
    found: list[OutputConstraint] = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(OutputConstraint(StructuredOutputsParams(json_object=True), "response_format"))
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema.json_schema if response_format.json_schema else None
        if schema is None:
            raise OpenAIError("response_format.json_schema.schema: required with type json_schema",
                              param="response_format.json_schema.schema")
        found.append(OutputConstraint(StructuredOutputsParams(json=schema), "response_format.json_schema.schema"))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(OutputConstraint(_params(fields, "structured_outputs"), "structured_outputs"))
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append(OutputConstraint(_params({kind: value}, name), name))
    if isinstance(request, ChatCompletionRequest):
        tools = _tool_constraint(request, config)
        if tools is not None:
            found.append(tools)
    grammars = [c for c in found if c.structured_outputs is not None]
    if len(grammars) > 1:
        names = [str(c.param) for c in grammars]
        raise OpenAIError(f"{names[1]}: only one output constraint per request; got {', '.join(names)}",
                          param=names[1])
    # tool_choice "auto" adds no grammar: the model's calls are parsed from whatever it writes, constrained or not.
    constraint = grammars[0] if grammars else OutputConstraint()
    parsers = [c.tool_parser for c in found if c.tool_parser is not None]
    if parsers:
        constraint.tool_parser = parsers[0]
    _apply_whitespace_pattern(constraint, _string_field(request, "guided_whitespace_pattern"))
    backends = _backends(engine_config, _string_field(request, "guided_decoding_backend"))
    if constraint.structured_outputs is not None:
        try:
            validate_structured_outputs(constraint.structured_outputs, backends)
        except ValueError as err:
            raise OpenAIError(f"{constraint.param}: {err}", param=constraint.param) from None
    return constraint


def _string_field(request: SamplingRequest, name: str) -> str | None:
    """One of vLLM's guided_* options: a field of the request model, or kept among its extra fields."""
    value = getattr(request, name, None)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(f"{name}: must be a string, got {type(value).__name__}", param=name)
    return value


def _apply_whitespace_pattern(constraint: OutputConstraint, pattern: str | None) -> None:
    """guided_whitespace_pattern: the whitespace a JSON constraint allows between its tokens (llguidance's option:
    such a request goes to the guidance backend)."""
    if pattern is None:
        return
    name, params = "guided_whitespace_pattern", constraint.structured_outputs
    if params is None or params.kind not in ("json", "json_object"):
        what = "no output constraint" if params is None else f"a {params.kind} constraint ({constraint.param})"
        raise OpenAIError(f"{name}: applies to JSON output (response_format, guided_json, structured_outputs.json, "
                          f"forced tool calls); this request has {what}", param=name)
    if params.whitespace_pattern is not None:
        raise OpenAIError(f"{name}: the request gives structured_outputs.whitespace_pattern too; give one",
                          param=name)
    try:
        constraint.structured_outputs = replace(params, whitespace_pattern=pattern)
    except ValueError as err:
        raise OpenAIError(f"{name}: {err}", param=name) from None


def _backends(engine_config: EngineConfig, named: str | None) -> tuple[str, ...]:
    """The engine's grammar backends, or the one guided_decoding_backend names (vLLM's per-request choice)."""
    backends = engine_config.resolved.structured_outputs_backends
    if named is None or named == "auto":
        return backends
    if named not in backends:
        setting = engine_config.structured_outputs_config.structured_outputs_backend
        raise OpenAIError(f"guided_decoding_backend: {named!r} is not a grammar backend of this engine (its "
                          f"structured_outputs_backend is {setting!r}); use one of "
                          f"{', '.join(repr(b) for b in ('auto', *backends))}, or leave it out", param=
                          "guided_decoding_backend")
    return (named,)


def _params(fields: dict, param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as err:
        raise OpenAIError(f"{param}: {err}", param=param) from None


def tool_choice_of(request: ChatCompletionRequest, config: StructuredOutputsConfig) -> str:
    """none | auto | required | named; without tool_choice: auto when tools are given and auto is enabled."""
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools and config.enable_auto_tool_choice else "none"
    return choice if isinstance(choice, str) else "named"


def _tool_constraint(request: ChatCompletionRequest, config: StructuredOutputsConfig) -> OutputConstraint | None:
    choice = tool_choice_of(request, config)
    tools = request.tools or []
    if choice != "none" and not tools:
        raise OpenAIError(f"tool_choice: {choice!r} needs tools", param="tool_choice")
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise OpenAIError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                              "--tool-call-parser", param="tool_choice")
        parser_name = config.tool_call_parser
        return OutputConstraint(tool_parser=lambda: get_tool_parser(parser_name))
    if choice == "required":
        schema = required_schema(tools, request.parallel_tool_calls is not False)
        return OutputConstraint(StructuredOutputsParams(json=schema), "tools", RequiredToolCallParser)
    if choice == "named":
        assert request.tool_choice is not None and not isinstance(request.tool_choice, str)
        name = request.tool_choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise OpenAIError(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
        return OutputConstraint(StructuredOutputsParams(json=parameters_schema(tool)), "tools",
                                lambda: NamedToolCallParser(name))
    return None
