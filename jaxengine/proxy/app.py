"""`build_proxy_app`: the OpenAI-compatible front of a prefill/decode disaggregated deployment,
as vLLM's disaggregated-serving example proxy does it.

Each /v1/completions or /v1/chat/completions request goes twice:

1. to a prefill instance (`--kv-transfer-config '{"kv_role": "kv_producer"}'`), with
   `max_tokens=1`, not streamed, and `kv_transfer_params={"do_remote_decode": true}`: it
   computes the prompt and answers with a handle to the KV it keeps;
2. to a decode instance (`kv_consumer`), as the client sent it plus that handle in
   `kv_transfer_params`: it loads the KV and generates; its answer, streamed or not, goes back
   to the client unchanged.

A prefill instance is chosen by the data-parallel router's rule (`replicas.router.choose`): the
longest prefix the proxy has sent there before (`PrefixIndex`, its estimate of that instance's
prefix cache), then the fewest requests in flight from this proxy; a decode instance by the
fewest in flight, ties to the lowest index. An answer other than 200 from an instance goes back
as it is; an instance that cannot be reached is a 502 naming it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxengine.proxy.prefixes import PrefixIndex
from jaxengine.replicas.router import choose

FORWARDED_HEADERS = ("authorization", "x-request-id")  # the API key, the request id


@dataclass
class Instance:
    """One engine server behind the proxy."""

    url: str  # e.g. "http://127.0.0.1:8100"
    in_flight: int = 0  # this proxy's requests it is serving now
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # prefill instances': sent

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Count a request in flight here while the block runs."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


def pick(instances: Sequence[Instance], prompt: str | None = None) -> Instance:
    """The instance for a request: the router's rule over the prefix hit of `prompt` (None:
    by load alone) and the requests in flight."""
    hits = [0 if prompt is None else i.prefixes.hit(prompt) for i in instances]
    return instances[choose(hits, [i.in_flight for i in instances])]


def prompt_key(body: dict[str, Any]) -> str:
    """What the prefix estimate compares: the completion prompt, or the chat messages."""
    prompt = body.get("prompt", body.get("messages", ""))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as a prefill instance gets it (vLLM's example proxy's changes)."""
    out = {**body, "max_tokens": 1, "stream": False,
           "kv_transfer_params": {"do_remote_decode": True}}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_proxy_app(prefill: Sequence[str], decode: Sequence[str], *,
                    timeout_s: float = 600.0) -> FastAPI:
    """The proxy over prefill instances `prefill` and decode instances `decode` (base URLs).

    Args:
      timeout_s: the longest the proxy waits on an instance for one request.
    Raises:
      ValueError: no prefill or no decode instance given.
    """
    if not prefill or not decode:
        raise ValueError(f"the proxy needs at least one prefill and one decode instance; got "
                         f"prefill={list(prefill)}, decode={list(decode)}")
    prefills = [Instance(u.rstrip("/")) for u in prefill]
    decodes = [Instance(u.rstrip("/")) for u in decode]
    client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="jaxengine P/D proxy", lifespan=lifespan)

    async def relay(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if body.get("n", 1) != 1 or isinstance(body.get("prompt"), list) and any(
                isinstance(p, str | list) for p in body["prompt"]):
            return _error(400, "the P/D proxy serves one prompt with n=1 per request (a "
                               "request's KV is handed on once); send several requests")
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        key = prompt_key(body)
        p = pick(prefills, key)
        with p.busy():
            try:
                answer = await client.post(p.url + path, json=prefill_body(body),
                                           headers=headers)
            except httpx.HTTPError as e:
                return _error(502, f"prefill instance {p.url} failed: {e!r}")
        if answer.status_code != 200:
            return _passed_on(answer)
        p.prefixes.add(key)
        decode_body = {**body, "kv_transfer_params": answer.json().get("kv_transfer_params")}
        d = pick(decodes)
        if body.get("stream"):
            return await _stream(client, d, path, decode_body, headers)
        with d.busy():
            try:
                answer = await client.post(d.url + path, json=decode_body, headers=headers)
            except httpx.HTTPError as e:
                return _error(502, f"decode instance {d.url} failed: {e!r}")
        return _passed_on(answer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return _passed_on(await client.get(decodes[0].url + "/v1/models"))
        except httpx.HTTPError as e:
            return _error(502, f"decode instance {decodes[0].url} failed: {e!r}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


async def _stream(client: httpx.AsyncClient, d: Instance, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> Response:
    """The decode instance's streamed answer, chunk by chunk; a client that leaves closes the
    upstream stream, so the instance sees the disconnect and aborts the request."""
    d.in_flight += 1
    try:
        upstream = await client.send(client.build_request("POST", d.url + path, json=body,
                                                          headers=headers), stream=True)
    except httpx.HTTPError as e:
        d.in_flight -= 1
        return _error(502, f"decode instance {d.url} failed: {e!r}")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            d.in_flight -= 1
            await upstream.aclose()

    return StreamingResponse(chunks(), status_code=upstream.status_code,
                             media_type=upstream.headers.get("content-type"))


def _passed_on(answer: httpx.Response) -> Response:
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"))


def _error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "BadGatewayError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)
