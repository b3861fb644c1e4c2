"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis (slow): for every operation
it draws requests that the schema allows (every field, every type it names, values of any size)
and requests it does not (wrong types, missing and extra fields), and sends them to a real
server. No answer may be a 5xx, every error is OpenAI's error shape without internals, and
afterwards the server is alive, idle and has every KV block free."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

from tests.jaxengine.server.test_harness import RunningServer, start_server, wait_until_idle

pytestmark = pytest.mark.slow

EXAMPLES = 60  # per operation and generation mode; derandomized: every run draws the same


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server()
    yield running
    running.stop()


def _check_error_shape(response: schemathesis.Response) -> None:
    if response.status_code < 400 or response.status_code == 404:
        return
    error = json.loads(response.text)["error"]
    assert isinstance(error["message"], str) and error["message"]
    for internal in ("Traceback", "backtrace", "panicked", ".py", "Refused("):
        assert internal not in error["message"], error["message"]


def test_requests_the_schema_allows_and_refuses_never_get_a_5xx(server: RunningServer) -> None:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = {op.path for op in operations if op.method.upper() == "POST"}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= posts
    sent: Counter[tuple[str, str]] = Counter()
    for op, mode in itertools.product(operations, schemathesis.GenerationMode):
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case: schemathesis.Case) -> None:
            response = case.call(base_url=server.base_url, timeout=60)
            sent[case.path, mode.value] += 1  # noqa: B023 (run at once, inside the loop)
            case.validate_response(response, checks=[not_a_server_error])
            _check_error_shape(response)

        try:
            fuzz()
        except Unsatisfiable:  # nothing to refuse: no parameters, or a body of any JSON
            assert mode is schemathesis.GenerationMode.NEGATIVE, op.path
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert min(sent[path, "positive"], sent[path, "negative"]) >= EXAMPLES // 2, sent
    assert server.async_engine is not None
    wait_until_idle(server, timeout_s=60)
