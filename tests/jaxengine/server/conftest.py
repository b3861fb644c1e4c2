"""The server tests' shared fixtures: one tiny-model server per session, and an official
`openai` client of it per module (a module with its own `server` fixture gets a client of
that one)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.jaxengine.server.test_harness import RunningServer, shared_server


@pytest.fixture(scope="module")
def server(pytestconfig: pytest.Config) -> RunningServer:
    return shared_server(pytestconfig)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    # trust_env=False: never route loopback traffic through a proxy from the environment.
    # Closed at the end: an unclosed socket is a ResourceWarning, an error under pytest here.
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                       timeout=120, http_client=httpx.Client(trust_env=False)) as client:
        yield client
