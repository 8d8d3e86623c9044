"""/openapi.json as the server really answers: every route's error bodies (400 bad input, 401 without the API key,
404 unknown model, 500 a request the server failed, 503 engine down) in OpenAI's error shape instead of FastAPI's 422
it never sends (its validation errors are answered as 400), streams as text/event-stream (with the error event a
stream ends with when the server fails it after its 200), /metrics as text/plain and /health without a body."""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from raylm.cluster.entrypoints.openai.protocol import ErrorResponse

_ERROR_REF = "#/components/schemas/ErrorResponse"
# Which errors each kind of route can answer, besides what every /v1 route can (401 when an API key is set).
_FAILED, _DOWN = HTTPStatus.INTERNAL_SERVER_ERROR, HTTPStatus.SERVICE_UNAVAILABLE
_GENERATION_ERRORS = (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND, _FAILED, _DOWN)
_ROUTE_ERRORS: dict[tuple[str, str], tuple[HTTPStatus, ...]] = {
    ("/v1/completions", "post"): _GENERATION_ERRORS,
    ("/v1/chat/completions", "post"): _GENERATION_ERRORS,
    ("/v1/embeddings", "post"): _GENERATION_ERRORS,
    ("/v1/models", "get"): (_FAILED, _DOWN),
    ("/v1/models/{model_id}", "get"): (HTTPStatus.NOT_FOUND, _FAILED, _DOWN),
    ("/health", "get"): (_DOWN,),
}
_DESCRIPTIONS = {
    HTTPStatus.INTERNAL_SERVER_ERROR: "The server failed the request: the engine could not serve it (e.g. its output "
                                      "constraint did not compile; finish_reason \"error\" inside the engine), or "
                                      "an internal error",
    HTTPStatus.SERVICE_UNAVAILABLE: "The engine is still loading the model, or has stopped",
}
_STREAM_DESCRIPTION = ("With stream: true, server-sent events: one chunk's JSON per `data:` event, then "
                       "`data: [DONE]`. A stream the server fails after its 200 ends with an error event, "
                       "`data: {\"error\": {message, type, param, code}}` (an ErrorResponse; code 500, or 503 for "
                       "an engine that stopped), then `data: [DONE]`.")
_STREAMING = {"/v1/completions", "/v1/chat/completions"}
# Why a request that matches the schema can still be refused: what no schema can say (it depends on the model, the
# tokenizer or another field). (reason, a pattern of the error messages it gives.)
SEMANTIC_400_REASONS: tuple[tuple[str, str], ...] = (
    ("the prompt (with max_tokens) does not fit max_model_len", r"maximum context length|is too large"),
    ("the prompt or logit_bias holds token ids outside the vocabulary, or the prompt none once tokenized",
     r"outside the vocabulary|it is empty"),
    ("min_tokens is larger than max_tokens", r"^min_tokens must be <="),
    ("best_of is not n (raylm has no beam search)", r"^best_of must equal n"),
    ("an output constraint (response_format, structured_outputs, guided_*, forced tools) cannot be compiled or "
     "enforced, more than one is given, or its fields contradict each other", r"backend|not valid JSON|"
     r"StructuredOutputsParams|only one output constraint|json_schema.schema: required|contradict each other"),
    ("tool_choice does not match the tools, or needs --enable-auto-tool-choice", r"^tool_choice: "),
    ("guided_whitespace_pattern is given without a JSON constraint (or beside structured_outputs.whitespace_pattern); "
     "guided_decoding_backend names a backend this engine does not have", r"^guided_(whitespace_pattern|decoding_"
                                                                         r"backend): "),
    ("the chat template rejects the messages", r"the chat template failed"),
    ("priority is given without scheduling_policy 'priority'", r"scheduling_policy"),
    ("embeddings: dimensions is given for a model without Matryoshka representation, or is not one of its "
     "matryoshka_dimensions", r"^dimensions: "),
)


def install_openapi(app: FastAPI, api_key: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe(get_openapi(title=app.title, version=app.version, routes=app.routes),
                                          api_key)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def describe(schema: dict[str, Any], api_key: bool) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
                      .pop("$defs", {}))
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            statuses = list(_ROUTE_ERRORS.get((path, method), ()))
            if path.startswith("/v1/") and api_key:
                statuses.append(HTTPStatus.UNAUTHORIZED)
            for status in statuses:
                description = _DESCRIPTIONS.get(status, status.phrase)
                if status == HTTPStatus.BAD_REQUEST:
                    description = ("A field out of its range, or a request the schema cannot rule out: " +
                                   "; ".join(reason for reason, _ in SEMANTIC_400_REASONS))
                responses[str(status.value)] = {"description": description, "content": {
                    "application/json": {"schema": {"$ref": _ERROR_REF}}}}
            if path in _STREAMING:
                # Server-sent events: no schema of a single value; the description says the events.
                responses["200"]["description"] = _STREAM_DESCRIPTION
                responses["200"].setdefault("content", {})["text/event-stream"] = {}
    paths = schema.get("paths", {})
    if "/health" in paths:
        paths["/health"]["get"]["responses"]["200"] = {"description": "the engine is up (no body)"}
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"]["200"] = {"description": "Prometheus exposition", "content": {
            "text/plain": {"schema": {"type": "string"}}}}
    return schema
