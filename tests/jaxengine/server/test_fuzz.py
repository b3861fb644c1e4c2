"""The HTTP API fuzzed from its own OpenAPI schema (slow): hypothesis-jsonschema draws bodies
that the schema allows (every field, every type it names, strings and numbers of any size)
and bodies it does not (any JSON), httpx posts them to a real server. No answer may be a 5xx,
every error is OpenAI's error shape, and afterwards the server is alive, idle and leaks no KV
block."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from tests.jaxengine.server.test_harness import RunningServer, start_server, wait_until_idle

pytestmark = pytest.mark.slow

EXAMPLES = 150  # per endpoint and kind of body; derandomized, so every run draws the same
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
        yield client


def _body_schemas(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each POST route's JSON body schema, its `#/components/schemas` references resolved
    against the document's components (as `$defs` of a standalone schema)."""
    defs = openapi.get("components", {}).get("schemas", {})
    out = {}
    for path, ops in openapi["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {})
        schema = body.get("application/json", {}).get("schema")
        if schema is not None:
            text = json.dumps({**schema, "$defs": defs})
            out[path] = json.loads(text.replace("#/components/schemas/", "#/$defs/"))
    return out


def _post(http: httpx.Client, path: str, body: Any) -> None:
    with http.stream("POST", path, json=body) as response:
        text = response.read().decode("utf-8", "replace")
    assert response.status_code < 500, (path, body, response.status_code, text[:500])
    if response.status_code >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], (path, body, text)
        assert "Traceback" not in error["message"] and "backtrace" not in error["message"]


def test_bodies_the_schema_allows_and_any_json_never_get_a_5xx(
        server: RunningServer, http: httpx.Client) -> None:
    schemas = _body_schemas(http.get("/openapi.json").json())
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schemas)
    for path, schema in sorted(schemas.items()):
        for bodies in (from_schema(schema), JSON):
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), database=None)
            @given(body=bodies)
            def fuzz(body: Any) -> None:
                _post(http, path, body)  # noqa: B023 (run at once, inside the loop)

            fuzz()
    assert http.get("/health").status_code == 200
    wait_until_idle(server, timeout_s=60)
