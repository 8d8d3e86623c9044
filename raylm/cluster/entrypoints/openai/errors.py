"""OpenAI-shaped errors, `{"error": {"message", "type", "param", "code"}}` with the HTTP status as code, for
our own errors and for FastAPI's (malformed JSON, wrong types, unknown routes)."""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from raylm.cluster.engine.outputs import EngineDeadError, EngineNotReadyError
from raylm.cluster.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "internal_server_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable_error",
}


class OpenAIError(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.response = error_response(message, status, param)


class GenerationError(OpenAIError):
    """The engine failed a request it had taken (finish_reason "error": its grammar failed to compile, say): the
    server's fault, a 500 whole or an error event streamed, never a 200 with what it wrote so far."""

    def __init__(self, message: str) -> None:
        super().__init__(f"the request failed in the server: {message}", HTTPStatus.INTERNAL_SERVER_ERROR)


def error_response(message: str, status: HTTPStatus | int, param: str | None = None) -> ErrorResponse:
    status = HTTPStatus(status)
    error_type = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status.value))


def error_from_exception(err: Exception) -> ErrorResponse:
    """Bad input (ValueError, as the engine raises it) is the client's 400; an engine down is a 503."""
    if isinstance(err, OpenAIError):
        if err.response.error.code >= HTTPStatus.INTERNAL_SERVER_ERROR:
            logger.warning("%s", err)
        return err.response
    if isinstance(err, ValueError):
        return error_response(str(err), HTTPStatus.BAD_REQUEST)
    if isinstance(err, EngineDeadError | EngineNotReadyError):
        return error_response(str(err), HTTPStatus.SERVICE_UNAVAILABLE)
    logger.error("request failed", exc_info=err)
    return error_response(f"internal error: {type(err).__name__}: {err}", HTTPStatus.INTERNAL_SERVER_ERROR)


def error_json(error: ErrorResponse, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.model_dump(mode="json"), status_code=error.error.code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 for a body they got wrong.
        problems = err.errors()
        if any(problem["type"] == "json_invalid" for problem in problems):
            return error_json(error_response("the request body is not valid JSON", HTTPStatus.BAD_REQUEST))
        where = [".".join(str(p) for p in problem["loc"] if p != "body") for problem in problems]
        message = "; ".join(f"{loc or 'body'}: {problem['msg'].removeprefix('Value error, ')}"
                            for loc, problem in zip(where, problems))
        # The request field at fault (not pydantic's path into a union member of it).
        param = next((str(part) for part in problems[0]["loc"] if part != "body"), None)
        return error_json(error_response(message, HTTPStatus.BAD_REQUEST, param))

    async def on_http_error(_: Request, err: HTTPException) -> JSONResponse:
        # Starlette's headers kept: a 405 names the allowed methods in Allow.
        return error_json(error_response(str(err.detail), err.status_code), getattr(err, "headers", None))

    async def on_error(_: Request, err: Exception) -> JSONResponse:
        return error_json(error_from_exception(err))

    # Starlette types every handler as taking any Exception; each of these is registered for its own class only.
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, on_http_error)  # type: ignore[arg-type]
    # Starlette runs Exception's handler in its outermost layer and then re-raises, so that the server logs the
    # traceback; the errors we expect are registered by class and answered without that.
    for expected in (OpenAIError, ValueError, EngineDeadError, EngineNotReadyError):
        app.add_exception_handler(expected, on_error)
    app.add_exception_handler(Exception, on_error)
