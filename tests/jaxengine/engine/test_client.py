"""`EngineClient`: the plain, data-parallel and multi-host engines each have every member (their
own, not forwarded), and the members that differ between them (`replicas`,
`compile_grammar`) do what the protocol says. On the fake model at tiny sizes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.client import EngineClient
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.model.fake import fake_model
from jaxengine.replicas.data_parallel import DataParallelEngine
from jaxengine.replicas.lockstep import LeaderEngine
from jaxengine.runner import runner as runner_module
from jaxengine.runner.bucket_programs import THREAD_NAME, make_program
from jaxengine.structured import StructuredOutputsParams
from scheduler import SamplingParams, SamplingParamsError
from tests.engine_helpers import engine_over
from tests.jaxengine.engine.test_llm_engine import V, make_engine

MEMBERS = {"args", "tokenizer", "max_model_len", "vocab_size", "scheduler_config", "replicas",
           "add_request", "abort_request", "has_unfinished_requests", "step",
           "compile_grammar", "add_lora", "remove_lora", "list_loras", "shutdown"}
ENGINES: dict[str, Callable[[], EngineClient]] = {
    "plain": make_engine,
    "data_parallel": lambda: DataParallelEngine([make_engine(), make_engine()]),
    "lockstep": lambda: LeaderEngine(make_engine()),  # one process: its exchange is a no-op
}
REGEX = StructuredOutputsParams(regex="(ab)+")


def _untokenized() -> LLMEngine:
    """A fake-model engine without a tokenizer: it cannot compile a grammar."""
    return engine_over(fake_model(V), EngineArgs(max_num_batched_tokens=32, max_num_seqs=4,
                                                 block_size=4),
                       tokenizer=None, max_model_len=64, num_blocks=50)


def test_the_protocol_lists_what_the_callers_read() -> None:
    assert {n for n in vars(EngineClient) if not n.startswith("_")} == MEMBERS


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_each_engine_has_every_member_of_its_own(kind: str) -> None:
    engine = ENGINES[kind]()
    assert isinstance(engine, EngineClient)
    # dir() lists the class's and the instance's attributes, never a __getattr__'s
    missing = MEMBERS - set(dir(engine))
    assert not missing, missing
    assert not hasattr(type(engine), "__getattr__")
    assert all(isinstance(r, LLMEngine) for r in engine.replicas)


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_each_engine_serves_a_request_through_the_protocol(kind: str) -> None:
    engine: EngineClient = ENGINES[kind]()
    replica = engine.replicas[0]
    assert (engine.args, engine.tokenizer, engine.vocab_size) == (
        replica.args, replica.tokenizer, replica.vocab_size)
    assert engine.max_model_len == replica.max_model_len == 256
    assert engine.scheduler_config == replica.scheduler_config
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    engine.add_request("b", {"prompt_token_ids": [4, 5]}, params)
    assert [o.request_id for o in engine.abort_request("b")] == ["b"]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(done) == ["a"] and len(done["a"].outputs[0].token_ids) == 3


def test_replicas_of_each_engine() -> None:
    single, inner = make_engine(), make_engine()
    dp = DataParallelEngine([make_engine() for _ in range(3)])
    assert single.replicas == (single,)
    assert len(dp.replicas) == 3
    assert LeaderEngine(inner).replicas == (inner,)


def test_only_the_plain_engine_compiles_a_grammar_up_front() -> None:
    with pytest.raises(SamplingParamsError, match="tokenizer"):
        _untokenized().compile_grammar(REGEX)
    # These compile in add_request, on the replica (or every process) the request reaches.
    DataParallelEngine([_untokenized()]).compile_grammar(REGEX)
    LeaderEngine(_untokenized()).compile_grammar(REGEX)


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_shutdown_ends_the_background_program_making(kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Background programs made slowly: without shutdown their threads would outlive it.
    def slow_make(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == THREAD_NAME:
            time.sleep(0.2)
        return make_program(*args, **kwargs)

    monkeypatch.setattr(runner_module, "make_program", slow_make)
    others = set(threading.enumerate())
    make = lambda: make_engine(precompile=True)  # noqa: E731
    engine = {"plain": make, "data_parallel": lambda: DataParallelEngine([make(), make()]),
              "lockstep": lambda: LeaderEngine(make())}[kind]()
    engine.shutdown()
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME and t not in others]
    engine.shutdown()  # idempotent
    replica = engine.replicas[0]  # the largest token bucket's step was never made
    replica.add_request("long", {"prompt_token_ids": list(range(1, 31))},
                        SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="never made: its runner was shut down"):
        replica.step()


def test_shutdown_stops_the_grammar_compiler_threads() -> None:
    engine = make_engine()
    engine.compile_grammar(REGEX)  # builds the compiler, which starts its threads
    compiler = engine.grammar_compiler
    assert [t for t in threading.enumerate() if t.name.startswith("grammar-compile")]
    engine.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("grammar-compile")]
    with pytest.raises(RuntimeError, match="shutdown"):
        compiler.submit(StructuredOutputsParams(regex="(cd)+"))
    engine.shutdown()  # idempotent
