"""ASGI middleware at the server's edge: the echo of the client's `X-Request-Id`.

Plain ASGI (not Starlette's `BaseHTTPMiddleware`, which buffers streamed responses): it wraps
`send` and passes everything else through.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case), as sent."""
    return next((v for k, v in scope["headers"] if k == name), None)


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
