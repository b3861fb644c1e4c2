"""Multi-host machinery in one process: the wire format, lockstep through the server's loop,
joining (or not) `jax.distributed`, and the serving roles. The two-process runs are in
test_multihost_processes.py."""

from __future__ import annotations

import asyncio
import importlib.util
import queue
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import pytest

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput
from jaxengine.model.fake import fake_greedy
from jaxengine.replicas.lockstep import (
    LeaderEngine,
    NewRequest,
    StepInputs,
    decode,
    encode,
    exchange,
    follow,
)
from jaxengine.runner.distributed import _detected_cluster, initialize_from_args, to_host
from jaxengine.server.async_engine import AsyncEngine
from jaxengine.server.run import _check_role
from scheduler import SamplingParams
from tests.jaxengine.engine.test_llm_engine import PROMPTS, V, make_engine

# Unseeded, so each request's seed comes from the engine's own generator, drawn in the order
# requests are added: followers get the same seeds only if they add in the same order.
# The fake model's chosen token has logit 10, the rest 0: at temperature 5 a draw often
# differs from it, so the seeds show.
SAMPLED = SamplingParams(max_tokens=10, temperature=5.0, top_k=5, ignore_eos=True)


def _inputs() -> StepInputs:
    odd = SamplingParams(max_tokens=None, temperature=0.1, top_p=0.3, min_p=0.05, seed=-2**63,
                         stop=("\udc80x", "é"), stop_token_ids=[3, 4], logprobs=2)
    return StepInputs(
        new_requests=(
            NewRequest(request_id="a", prompt="t\udc80xt é", params=odd, arrival_time=0.1,
                       priority=-3),
            NewRequest(request_id="b", prompt={"prompt": "p", "prompt_token_ids": [1, 2]},
                       params=SamplingParams(), arrival_time=1e9 + 1 / 3, priority=0),
            NewRequest(request_id="c", prompt=[7, 8], params=SAMPLED, arrival_time=2.0,
                       priority=0)),
        aborts=("x", "a"), shutdown=True)


def test_inputs_survive_the_wire_exactly() -> None:
    inputs = _inputs()
    assert decode(encode(inputs)) == inputs
    assert encode(StepInputs()) == b"" and decode(b"") == StepInputs()
    assert not StepInputs(shutdown=True).is_empty() and StepInputs().is_empty()


def test_exchange_with_one_process_returns_the_inputs_untouched() -> None:
    inputs = _inputs()
    assert jax.process_count() == 1
    assert exchange(inputs) is inputs


def test_to_host_with_one_process_is_device_get() -> None:
    tree = {"a": jax.numpy.arange(3), "b": (np.float32(2.5), jax.numpy.ones((2, 2)))}
    got = to_host(tree)
    np.testing.assert_array_equal(got["a"], [0, 1, 2])
    assert isinstance(got["b"][1], np.ndarray) and got["b"][0] == 2.5


def test_a_plain_machine_joins_nothing() -> None:
    initialize_from_args(EngineArgs())
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("tasks, found", [("1", None), ("2", "SlurmCluster")])
def test_a_slurm_job_of_several_tasks_is_detected(monkeypatch: pytest.MonkeyPatch, tasks: str,
                                                  found: str | None) -> None:
    assert _detected_cluster() is None  # this machine: no cluster
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node1", "SLURM_NTASKS": tasks,
                        "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert _detected_cluster() == found  # one task: nothing to join


def test_kubernetes_without_its_package_is_no_job_and_no_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert importlib.util.find_spec("kubernetes") is None  # as in this project's venv
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert _detected_cluster() is None  # jax warns here; pytest would make that an error
    initialize_from_args(EngineArgs())
    assert not jax.distributed.is_initialized()


def test_multi_host_arguments_after_jax_started_say_to_move_them_first() -> None:
    jax.devices()  # the backend is up, as in any test process
    args = EngineArgs(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="before any other JAX call"):
        initialize_from_args(args)
    assert not jax.distributed.is_initialized()


def test_only_process_0_serves_http() -> None:
    _check_role(0, 1, headless=False)
    _check_role(3, 4, headless=True)
    with pytest.raises(ValueError, match="drop --headless"):
        _check_role(0, 2, headless=True)
    with pytest.raises(ValueError, match="process 1 of 2.*--headless"):
        _check_role(1, 2, headless=False)


# ---- lockstep: a leader behind the real server loop, a follower in a thread ----------------

class Channel:
    """Two processes' `exchange` in one: the leader's side sends what the follower's side gets,
    through the wire format."""

    def __init__(self) -> None:
        self.wire: queue.Queue[bytes] = queue.Queue()

    def leader(self, inputs: StepInputs | None) -> StepInputs:
        assert inputs is not None
        self.wire.put(encode(inputs))
        return inputs

    def follower(self, inputs: StepInputs | None) -> StepInputs:
        return decode(self.wire.get(timeout=60))


class Recorder:
    """A follower's engine that keeps the last output of every request it produced."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.last = engine, {}

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        self.engine.add_request(*args, **kwargs)

    def abort_request(self, ids: Iterable[str]) -> list[RequestOutput]:
        return self._keep(self.engine.abort_request(ids))

    def step(self) -> list[RequestOutput]:
        return self._keep(self.engine.step())

    def _keep(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        self.last.update({o.request_id: o for o in outputs})
        return outputs


def _summary(out: RequestOutput) -> tuple[Any, ...]:
    c = out.outputs[0]
    return tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason


async def _serve_through(leader: LeaderEngine) -> dict[str, RequestOutput]:
    """Requests arriving at different times, a stop string, and one client that leaves."""
    server = AsyncEngine(leader, model_name="fake", log_interval=0)
    server.start()
    streams = [await server.add(f"r{i}", {"prompt_token_ids": p}, SAMPLED)
               for i, p in enumerate(PROMPTS[:3])]
    fifth = fake_greedy([5, 6, 7], 5, V)[-1]
    stop = SamplingParams(max_tokens=20, temperature=0.0, stop=[chr(0x100 + fifth)])
    streams.append(await server.add("stop", {"prompt_token_ids": [5, 6, 7]}, stop))
    leaving = await server.add("leaves", {"prompt_token_ids": PROMPTS[1]}, SAMPLED)
    async for _ in leaving:
        break
    leaving.abort()
    late = [await server.add(f"late{i}", {"prompt_token_ids": p}, SAMPLED)
            for i, p in enumerate(PROMPTS[3:])]
    finals = {s.request_id: await s.final() for s in streams + late}
    await server.stop()
    return finals


def test_a_follower_fed_by_the_leader_produces_the_same_outputs() -> None:
    channel, follower = Channel(), Recorder(make_engine())
    steps: list[int] = []
    thread = threading.Thread(
        target=lambda: steps.append(follow(follower, exchange_fn=channel.follower)),
        daemon=True)
    thread.start()
    leader = LeaderEngine(make_engine(), exchange_fn=channel.leader)
    finals = asyncio.run(asyncio.wait_for(_serve_through(leader), 120))
    leader.shutdown()
    thread.join(timeout=60)
    assert not thread.is_alive() and steps and steps[0] > 5
    assert finals.keys() | {"leaves"} == follower.last.keys()
    for rid, out in finals.items():
        assert _summary(follower.last[rid]) == _summary(out), rid
    assert finals["stop"].outputs[0].finish_reason == "stop"
    assert follower.last["leaves"].outputs[0].finish_reason == "abort"
    (engine,) = leader.replicas
    assert follower.engine.snapshot().num_free_blocks == engine.snapshot().num_free_blocks
    assert not follower.engine.has_unfinished_requests()


def test_the_leader_refuses_to_step_after_shutdown_and_shuts_down_once() -> None:
    channel = Channel()
    leader = LeaderEngine(make_engine(), exchange_fn=channel.leader)
    leader.add_request("a", {"prompt_token_ids": [1, 2]}, SAMPLED)
    leader.shutdown()
    leader.shutdown()
    assert channel.wire.qsize() == 1
    sent = decode(channel.wire.get())
    assert sent.shutdown and [r.request_id for r in sent.new_requests] == ["a"]
    with pytest.raises(RuntimeError, match="shut down"):
        leader.step()
