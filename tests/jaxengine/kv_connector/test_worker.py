"""The engine calls its `KVWorker` at the same points whichever kind it is: a worker of the
test's own, over the fake model, sees every call, and what it answers reaches the scheduler
and the outputs."""

from __future__ import annotations

from typing import Any

from jaxengine.kv_connector import KVWorker
from scheduler import (
    KVConnector,
    KVConnectorOutput,
    RequestView,
    SamplingParams,
    SchedulerOutput,
    SchedulerState,
    check_invariants,
)
from tests.jaxengine.engine.test_llm_engine import make_engine

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class HoldingConnector(KVConnector):
    """Holds every finished or aborted request's blocks until its save is reported."""

    def request_finished(self, request: RequestView, block_ids: tuple[int, ...]) -> bool:
        return True


class RecordingWorker(KVWorker):
    """Logs each call; "saves" each held request by reporting it in the next output."""

    records_stats = True

    def __init__(self) -> None:
        self.connector = HoldingConnector()
        self.calls: list[tuple[Any, ...]] = []
        self._saved: set[str] = set()

    def add_request(self, request_id: str, asked: object) -> None:
        self.calls.append(("add_request", request_id, asked))

    def start_step(self, plan: SchedulerOutput, state: SchedulerState, *, idle: bool) -> None:
        meta = plan.kv_connector_metadata
        saves = () if meta is None else tuple(s.req_id for s in meta.saves)
        self.calls.append(("start_step", saves, idle))
        self._saved.update(saves)

    def take_output(self) -> KVConnectorOutput | None:
        self.calls.append(("take_output",))
        if not self._saved:
            return None
        out = KVConnectorOutput(finished_sending=frozenset(self._saved))
        self._saved = set()
        return out

    def finish_request(self, request_id: str, *, held_blocks: tuple[int, ...] | None,
                       num_prompt_tokens: int) -> dict[str, Any] | None:
        self.calls.append(("finish_request", request_id, held_blocks, num_prompt_tokens))
        return None if held_blocks is None else {"held": list(held_blocks)}

    def record(self, stats: Any) -> None:
        self.calls.append(("record",))


def test_the_engine_without_a_connector_holds_the_base_worker() -> None:
    engine = make_engine()
    assert type(engine.kv_worker) is KVWorker and engine.kv_worker.connector is None
    assert engine.kv_offload is None and engine.kv_transfer is None


def test_every_call_reaches_the_worker_and_its_answers_reach_the_outputs() -> None:
    engine = make_engine(block_size=4, async_scheduling=False)  # one plan per call
    worker = engine.kv_worker = RecordingWorker()
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, PARAMS)
    engine.add_request("b", {"prompt_token_ids": [7, 8]}, PARAMS)
    assert worker.calls == [("add_request", "a", None), ("add_request", "b", None)]
    saves: list[tuple[tuple[str, ...], bool]] = []  # each step's (saves, idle)
    finished = []
    while engine.has_unfinished_requests():
        worker.calls.clear()
        finished += [o for o in engine.step() if o.finished]
        check_invariants(engine.state)
        # Each step: transfers before the dispatch, their results with the update, then stats.
        assert [c[0] for c in worker.calls[:2]] == ["start_step", "take_output"]
        assert worker.calls[-1] == ("record",)
        saves.append(worker.calls[0][1:])
        if len(saves) == 1:  # b has its prompt's block: aborted, it is held and saved
            worker.calls.clear()
            (aborted,) = engine.abort_request("b")
            (call, record) = worker.calls
            assert call[:2] == ("finish_request", "b") and call[3] == 2 and len(call[2]) == 1
            assert aborted.kv_transfer_params == {"held": list(call[2])} and record == ("record",)
    # a: 5 + 3 tokens, whose KV fills 2 blocks (the last token's is never computed).
    (out,) = finished
    assert out.request_id == "a" and len(out.kv_transfer_params["held"]) == 2
    # The step after each finish saves it; the last has nothing else to do: idle.
    assert saves == [((), False), (("b",), False), ((), False), (("a",), True)]
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
