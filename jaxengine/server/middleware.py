"""ASGI middleware at the server's edge: the API key, the request body's size, and the echo of
the client's `X-Request-Id`.

Plain ASGI (not Starlette's `BaseHTTPMiddleware`, which buffers streamed responses): each wraps
`receive` or `send` and passes everything else through. Their refusals are OpenAI error bodies,
as every other error of this server (`jaxengine.server.errors`).
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxengine.server.errors import error_response

# vLLM's: what load balancers and Prometheus poll, which have no key to send.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case), as sent."""
    return next((v for k, v in scope["headers"] if k == name), None)


class APIKeyMiddleware:
    """Every HTTP route but `OPEN_PATHS` needs `Authorization: Bearer KEY`; anything else is a
    401 `AuthenticationError`, before the request's body is read.

    vLLM guards only /v1/*; here /tokenize, /detokenize, /version and FastAPI's /docs need the
    key too: what is open is listed, and nothing else is.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        """Guard `app` with `api_key`."""
        self.app = app
        # Digests, compared in constant time: equal lengths, so not even the key's length leaks.
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass an authorized (or open) request on; answer 401 to the rest."""
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        message = self._refusal(_header(scope, b"authorization"))
        if message is None:
            await self.app(scope, receive, send)
            return
        response = error_response(message, code=401)
        response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme to use
        await response(scope, receive, send)

    def _refusal(self, authorization: bytes | None) -> str | None:
        """Why `authorization` (the header's value) is refused; None if it holds the key."""
        how = "send the header `Authorization: Bearer KEY` with the server's API key"
        if authorization is None:
            return f"no API key: {how}"
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return f"the Authorization header is not a Bearer token: {how}"
        if not hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest):
            return "invalid API key"
        return None


class BodyLimitMiddleware:
    """A request body over `max_bytes` is a 413: at once when its Content-Length says so (the
    body is never read), else as soon as the bytes received pass the limit (a chunked body)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        """Limit `app`'s request bodies to `max_bytes`."""
        self.app = app
        self.max_bytes = max_bytes

    def _message(self, declared: int | None = None) -> str:
        size = "" if declared is None else f" (Content-Length {declared})"
        return (f"the request body{size} is over this server's limit of {self.max_bytes} bytes "
                f"(jaxengine serve --max-request-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a declared oversized body; count the bytes of the others as they arrive."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._message(int(length)), code=413)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised into the endpoint reading the body: FastAPI passes an HTTPException
                    # through its body parsing, and the server's handler answers it in OpenAI's
                    # shape (`install_error_handlers`).
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)


class RequestIdHeaderMiddleware:
    """A response to a request with an `X-Request-Id` header carries it back, as vLLM's
    `--enable-request-id-headers` does (here always: it costs one header)."""

    def __init__(self, app: ASGIApp) -> None:
        """Echo the header around `app`."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Add the request's id to the response's headers."""
        request_id = _header(scope, b"x-request-id") if scope["type"] == "http" else None
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def echoing(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if all(k.lower() != b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", request_id))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, echoing)
