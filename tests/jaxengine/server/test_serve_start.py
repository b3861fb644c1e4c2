"""`serve`'s order of work, in-process with the engine and the HTTP server replaced: the HTTP
stack's imports are made beside the build and are done before serving starts, the chat
template's tokenizer beside the warm-up, and the engine is shut down once serving ends, however
it ends."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.server import run


class _Tokenizer:
    chat_template = "{{ messages[0].content }}"

    def __init__(self, events: list[str]) -> None:
        self._events = events

    @property
    def hf(self) -> None:
        self._events.append("chat template")


class _Engine:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.tokenizer = _Tokenizer(events)
        self.scheduler_config = SimpleNamespace(num_blocks=8)
        self.max_model_len = 64

    def shutdown(self) -> None:
        self.events.append("shutdown")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened, in order; `serve`'s engine and HTTP server are stand-ins recording it."""
    events: list[str] = []
    build_started = threading.Event()

    def import_http_stack() -> None:
        assert build_started.wait(10)  # on its own thread, while the build runs
        time.sleep(0.2)
        events.append("imports")

    def build(_: EngineArgs) -> _Engine:
        build_started.set()
        events.append("build")
        return _Engine(events)

    monkeypatch.setattr(run, "_import_http_stack", import_http_stack)
    monkeypatch.setattr(run, "build_engines", build)
    monkeypatch.setattr(run, "warm_up", lambda engine: events.append("warm-up"))
    return events


def test_serving_starts_after_the_imports_and_ends_in_shutdown(
        monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    def serve_http(engine: Any, name: str, **_: Any) -> None:
        events.append("serve " + name)

    monkeypatch.setattr(run, "_run_http", serve_http)
    run.serve(EngineArgs(), model_name="m", log_level="warning")
    for thread in threading.enumerate():
        if thread.name == "chat-template":  # not waited for by serve
            thread.join()
    assert events[0] == "build" and "chat template" in events
    assert events.index("imports") < events.index("serve m") < events.index("shutdown")


def test_a_server_that_fails_still_shuts_the_engine_down(monkeypatch: pytest.MonkeyPatch,
                                                         events: list[str]) -> None:
    def serve_http(engine: Any, name: str, **_: Any) -> None:
        raise OSError("address already in use")

    monkeypatch.setattr(run, "_run_http", serve_http)
    with pytest.raises(OSError, match="address already in use"):
        run.serve(EngineArgs(), model_name="m", log_level="warning")
    assert events[-1] == "shutdown"
