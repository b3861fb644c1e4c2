"""`jaxengine generate` and `jaxengine chat` stream: over the fake model, every write to stdout and
every engine step is logged in one list, which shows the text is written while the request runs.
"""

from __future__ import annotations

import io
import json
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from jaxengine import streaming
from jaxengine.cli import main
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput
from jaxengine.llm import LLM
from jaxengine.model.fake import fake_greedy, fake_model
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_llm_engine import V
from tests.jaxengine.test_llm import ChatTokenizer

TOK = ChatTokenizer()
GREEDY = ["--temperature", "0", "--ignore-eos"]


class Log:
    """Writes to stdout ("write", text) and engine steps ("step", {prompt: finished}), in order.

    `interrupts[n]` SIGINTs are raised after the n-th engine step (1-based), as Ctrl-C would.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.interrupts: dict[int, int] = {}
        self.steps = 0

    def write(self, text: str) -> int:
        self.events.append(("write", text))
        return len(text)

    def flush(self) -> None:
        self.events.append(("flush", None))

    def out(self) -> str:
        return "".join(x for kind, x in self.events if kind == "write")

    def writes_until_finished(self, prompt: str) -> list[str]:
        """The texts written before the step that finished the request of `prompt`."""
        written = []
        for kind, x in self.events:
            if kind == "step" and x.get(prompt):
                return written
            if kind == "write" and x:
                written.append(x)
        raise AssertionError(f"no step finished {prompt!r}")

    def engine(self) -> LLMEngine:
        """A fresh engine over the fake model, its steps logged; a prompt prefills at most 8
        tokens a step, so short prompts overtake a long one. The tests count steps exactly,
        so the loop is the synchronous one (a step's tokens come out of that step's call;
        streaming under async scheduling is tested in test_streaming.py)."""
        args = EngineArgs(max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
                          long_prefill_token_threshold=8, async_scheduling=False)
        engine = engine_over(fake_model(V), args, tokenizer=TOK, max_model_len=128,
                             num_blocks=64)
        real_step = engine.step

        def step() -> list[RequestOutput]:
            outs = real_step()
            self.steps += 1
            self.events.append(("step", {o.prompt: o.finished for o in outs}))
            for _ in range(self.interrupts.get(self.steps, 0)):
                signal.raise_signal(signal.SIGINT)
            return outs

        engine.step = step  # type: ignore[method-assign]
        return engine


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Iterator[Log]:
    """Each `jaxengine` command gets `log.engine()` and a stdout that logs its writes; SIGINT
    has Python's own handler, as in a process started from a terminal (one started in the
    background of a non-interactive shell inherits SIGINT ignored)."""
    log = Log()

    def build(args: EngineArgs) -> LLM:
        # stdout is taken here, in the test's call: pytest's capture sets it anew per phase
        monkeypatch.setattr(sys, "stdout", log)
        return LLM.from_engine(log.engine())

    monkeypatch.setattr("jaxengine.cli._build_llm", build)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield log
    finally:
        signal.signal(signal.SIGINT, previous)


def test_generate_streams_the_first_prompt_and_prints_all_in_order(log: Log) -> None:
    # the long first prompt prefills 8 tokens a step: the short ones finish before it
    prompts = [TOK.decode(list(range(1, 50))), TOK.decode([5, 6, 7]), TOK.decode([9] * 13)]
    assert main(["generate", *prompts, "--max-tokens", "6", *GREEDY]) == 0
    texts = [TOK.decode(fake_greedy(TOK.encode(p), 6, V)) for p in prompts]
    assert log.out() == "".join(t + "\n" for t in texts)
    finished = [p for kind, x in log.events if kind == "step" for p, done in x.items() if done]
    assert finished[-1] == prompts[0]  # the engine finished it last; it was printed first
    early = log.writes_until_finished(prompts[0])
    assert len(early) == 5 and "".join(early) == texts[0][:5]  # a piece a token, while running
    assert all(log.events[i + 1][0] == "flush" for i, (kind, x) in enumerate(log.events)
               if kind == "write")


def test_generate_json_is_not_streamed(log: Log) -> None:
    prompts = [TOK.decode([5, 6, 7]), TOK.decode([9] * 13)]
    assert main(["generate", *prompts, "--max-tokens", "6", "--json", *GREEDY]) == 0
    lines = [json.loads(x) for x in log.out().splitlines()]
    assert [x["prompt"] for x in lines] == prompts
    assert [x["text"] for x in lines] == [
        TOK.decode(fake_greedy(TOK.encode(p), 6, V)) for p in prompts]
    assert log.writes_until_finished(prompts[1]) == []  # nothing before all were done


def test_generate_never_prints_a_stop_string(log: Log) -> None:
    prompt = TOK.decode([5, 6, 7])
    full = TOK.decode(fake_greedy([5, 6, 7], 10, V))
    assert main(["generate", prompt, "--max-tokens", "10", "--stop", full[6:9], *GREEDY]) == 0
    assert log.out() == full[:6] + "\n"
    # a piece a token, two characters behind: they might begin the stop string
    assert log.writes_until_finished(prompt) == list(full[:6])
    first_write = next(i for i, (kind, x) in enumerate(log.events) if kind == "write" and x)
    assert [kind for kind, _ in log.events[:first_write]] == ["step"] * 3


def _chat(monkeypatch: pytest.MonkeyPatch, turns: list[list[int]]) -> list[list[dict]]:
    """Feed `turns` (token ids of each user line) to `jaxengine chat`; the conversations it
    streamed replies to."""
    seen: list[list[dict]] = []
    real = streaming.stream_chat

    def spy(llm: LLM, conversation: Any, *a: Any, **kw: Any) -> streaming.TextStream:
        seen.append([dict(m) for m in conversation])
        return real(llm, conversation, *a, **kw)

    monkeypatch.setattr(streaming, "stream_chat", spy)
    lines = "".join(TOK.decode(t) + "\n" for t in turns)
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    return seen


def test_chat_streams_each_reply_and_keeps_the_conversation(
        log: Log, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _chat(monkeypatch, [[10, 11], [12]])
    assert main(["chat", "--max-tokens", "5", *GREEDY]) == 0
    first = fake_greedy([1, 10, 11, 2], 5, V)
    second = fake_greedy([1, 10, 11, 2, *first, 1, 12, 2], 5, V)
    assert log.out() == TOK.decode(first) + "\n" + TOK.decode(second) + "\n"
    assert seen[1] == [{"role": "user", "content": TOK.decode([10, 11])},
                       {"role": "assistant", "content": TOK.decode(first)},
                       {"role": "user", "content": TOK.decode([12])}]
    assert len(log.writes_until_finished(TOK.decode([1, 10, 11, 2]))) == 4


def test_ctrl_c_aborts_the_reply_and_the_chat_goes_on(
        log: Log, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen = _chat(monkeypatch, [[10, 11], [12]])
    log.interrupts[2] = 1  # after the reply's second step
    assert main(["chat", "--max-tokens", "8", *GREEDY]) == 0
    first = TOK.decode(fake_greedy([1, 10, 11, 2], 8, V))
    second = TOK.decode(fake_greedy([1, 12, 2], 8, V))  # the aborted turn was not kept
    assert log.out() == first[:2] + "\n" + second + "\n"
    assert seen[1] == [{"role": "user", "content": TOK.decode([12])}]
    assert "aborted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_exits_and_leaves_the_engine_empty(
        log: Log, monkeypatch: pytest.MonkeyPatch) -> None:
    engines: list[Any] = []
    real = streaming.stream_chat

    def keep(llm: LLM, *a: Any, **kw: Any) -> streaming.TextStream:
        engines.append(llm.llm_engine)
        return real(llm, *a, **kw)

    _chat(monkeypatch, [[10, 11], [12]])
    monkeypatch.setattr(streaming, "stream_chat", keep)
    log.interrupts[2] = 2
    assert main(["chat", "--max-tokens", "8", *GREEDY]) == 130
    assert not engines[0].has_unfinished_requests()
    assert engines[0].state.num_free_blocks == engines[0].scheduler_config.num_blocks - 1
    first = TOK.decode(fake_greedy([1, 10, 11, 2], 8, V))
    assert log.out() == first[:1]  # KeyboardInterrupt came inside step 2, before its piece
