"""OpenAI-style error bodies, and handlers that turn every client mistake into one.

`{"error": {"message": ..., "type": "BadRequestError", "param": ..., "code": 400}}` is what
OpenAI's clients parse; FastAPI's own 422 validation errors (malformed JSON, wrong types,
missing fields) are converted to that 400 shape.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxengine.server.protocol import RequestError
from jaxengine.server.response_bodies import ErrorInfo, ErrorResponse, to_json
from scheduler import SamplingParamsError

logger = logging.getLogger("jaxengine.server")

# The `openai` client's exception names where it has one (401: AuthenticationError); 413 is
# pinned because its phrase differs between Python versions.
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(message: str, *, code: int = 400, param: str | None = None) -> ErrorResponse:
    """The OpenAI error object for `code`."""
    err_type = _TYPES.get(code) or HTTPStatus(code).phrase.replace(" ", "") + "Error"
    # A message that quotes the request may carry a lone surrogate, which UTF-8 cannot encode:
    # escape it, or rendering the error would itself fail and drop the connection.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code))


def error_response(message: str, *, code: int = 400, param: str | None = None) -> Response:
    """A JSON error response."""
    return Response(to_json(error_body(message, code=code, param=param)), status_code=code,
                    media_type="application/json")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-before", "literal", "model"}
# pydantic's messages that would name our classes ("... or instance of StreamOptions"), in JSON's
# words instead
_OBJECT_EXPECTED = {"model_type", "model_attributes_type", "dict_type"}


def _field_path(loc: Any) -> list[str]:
    """The field path of a pydantic error location, without "body" and union-member tags."""
    path = []
    for part in loc:
        text = str(part)
        if text == "body":
            continue
        if text.split("[", 1)[0] in _TYPE_TAGS or "[" in text:
            break  # pydantic names the union member it tried; the field ends here
        path.append(text)
    return path


def _unknown_path(loc: Any) -> list[str]:
    """The whole path of an unknown field, through the union members pydantic tried."""
    return [str(part) for part in loc
            if str(part) != "body" and str(part).split("[", 1)[0] not in _TYPE_TAGS]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the offending top-level field from pydantic's error list."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    path = _field_path(first.get("loc", ()))
    if not path:
        return "the request body must be a JSON object with the request's fields", None
    field = ".".join(path)
    unknown = [_unknown_path(e["loc"]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # nothing is silently ignored: an unknown field is an error that names it
        names = ", ".join(f"'{'.'.join(name)}'" for name in unknown)
        return (f"unknown field {names}: not an OpenAI or vLLM request field this server knows; "
                f"remove it (docs/DESIGN.md lists the fields)", unknown[0][0])
    same = [e for e in errors if _field_path(e.get("loc", ())) == path]
    reasons = list(dict.fromkeys(_reason(e) for e in same))
    others = sorted({".".join(_field_path(e.get("loc", ()))) for e in errors} - {field})
    message = f"invalid '{field}': " + "; or ".join(reasons)
    if str(same[0].get("type", "")).endswith("_type"):  # the wrong type: say which it was
        message += f" (got {_json_type(same[0].get('input'))})"
    if others:
        message += f" (also invalid: {', '.join(others)})"
    return message, path[0]


def _reason(error: Any) -> str:
    """What one of pydantic's errors says is wrong."""
    if error.get("type") in _OBJECT_EXPECTED:
        return "Input should be an object"
    # a validator's ValueError: its message is ours, already written for the client
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")


def _json_type(value: Any) -> str:
    """The JSON type of a parsed value, as a client would name it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    names = {str: "a string", list: "an array", dict: "an object"}
    return next((name for kind, name in names.items() if isinstance(value, kind)), "null")


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers for validation errors, `RequestError`/`ValueError` and HTTP errors."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(message, param=param)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> Response:
        return error_response(str(exc), code=exc.code, param=exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> Response:
        # The endpoints turn a SamplingParamsError into a RequestError with the request's field
        # name; one that got past them still names its field, as data. Others name none.
        param = exc.param if isinstance(exc, SamplingParamsError) else None
        return error_response(str(exc), param=param)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        # What went wrong is the server's to know: the log has it, the client is told that.
        logger.error("unhandled error in a request", exc_info=exc)
        return error_response("internal server error (the server's log has the details)",
                              code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(str(exc.detail), code=exc.status_code)
