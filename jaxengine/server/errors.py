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
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxengine.server.protocol import RequestError

logger = logging.getLogger("jaxengine.server")

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(message: str, *, code: int = 400, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for `code`."""
    err_type = _TYPES.get(code) or HTTPStatus(code).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(message: str, *, code: int = 400, param: str | None = None) -> JSONResponse:
    """A JSON error response."""
    return JSONResponse(error_body(message, code=code, param=param), status_code=code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the first offending field from pydantic's error list."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
             f"{e.get('msg', 'invalid')}" for e in errors[:5]]
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return f"invalid value for {where}: " + "; ".join(parts) + more, param


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers for validation errors, `RequestError`/`ValueError` and HTTP errors."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, param=param)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(str(exc), param=exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), code=exc.status_code)
