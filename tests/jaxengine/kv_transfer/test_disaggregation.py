"""Prefill/decode disaggregation in process: a producer engine and a consumer engine over the
fake model (whose next token is a function of the KV it reads back through the block table, so
a page lost or misplaced in the transfer changes the output), talking TCP on 127.0.0.1, or
`jax.experimental.transfer` (the "jax" transport, which runs on CPU too)."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.kv_transfer import fetch_pages
from jaxengine.model.fake import fake_greedy
from scheduler import SamplingParams, check_invariants
from tests.jaxengine.engine.test_llm_engine import V, make_engine

PROMPTS = [list(range(1, 42)), [9] * 13, [5, 6, 7], list(range(40, 47))]


def engines(*, abort_timeout_s: float = 60, fetch_timeout_s: float = 10,
            async_scheduling: bool = True,
            roles: tuple[str, str] = ("kv_producer", "kv_consumer"), transport: str = "tcp"
            ) -> tuple[LLMEngine, LLMEngine]:
    extra = {"abort_timeout_s": abort_timeout_s, "fetch_timeout_s": fetch_timeout_s,
             "transport": transport}
    producer = make_engine(async_scheduling=async_scheduling, kv_transfer_config={
        "kv_role": roles[0], "kv_port": 0, "kv_connector_extra_config": extra})
    consumer = make_engine(async_scheduling=async_scheduling, kv_transfer_config={
        "kv_role": roles[1], "kv_port": 0, "kv_connector_extra_config": extra})
    return producer, consumer


def params(kv_transfer_params: dict[str, Any] | None, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args={"kv_transfer_params": kv_transfer_params})


def prefill(producer: LLMEngine, prompts: list[list[int]]) -> dict[str, dict[str, Any]]:
    """Each prompt through the producer with max_tokens=1, as the proxy sends it: handles."""
    for i, p in enumerate(prompts):
        producer.add_request(f"r{i}", {"prompt_token_ids": p},
                             params({"do_remote_decode": True}, max_tokens=1))
    handles = {}
    while len(handles) < len(prompts):
        for out in producer.step():
            if out.finished:
                assert out.kv_transfer_params is not None
                handles[out.request_id] = out.kv_transfer_params
        check_invariants(producer.state)
    # tcp holds the blocks for the pickup; jax frees them the step after the pages are offered
    held = producer.state.held_req_ids
    assert held == frozenset(handles) if producer.kv_transfer.transport == "tcp" else (
        held <= frozenset(handles))
    return handles


def decode(consumer: LLMEngine, producer: LLMEngine, prompts: list[list[int]],
           handles: dict[str, dict[str, Any]], *, aborts: tuple[str, ...] = ()
           ) -> dict[str, Any]:
    """The prompts through the consumer with the producer's handles (the producer stepping
    beside it, as a served one does), to the end; finished outputs by id. Neither engine may
    be left holding a block."""
    for i, p in enumerate(prompts):
        consumer.add_request(f"r{i}", {"prompt_token_ids": p}, params(handles.get(f"r{i}")))
    consumer.abort_request(aborts)
    done, deadline = {}, time.monotonic() + 30
    while consumer.has_unfinished_requests() or producer.has_unfinished_requests():
        if producer.has_unfinished_requests():
            producer.step()
        for out in consumer.step():
            if out.finished:
                done[out.request_id] = out
        check_invariants(consumer.state)
        check_invariants(producer.state)
        assert time.monotonic() < deadline
    for engine in (producer, consumer):
        assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    return done


@pytest.mark.parametrize(("async_scheduling", "roles", "transport"), [
    (False, ("kv_producer", "kv_consumer"), "tcp"), (True, ("kv_producer", "kv_consumer"), "tcp"),
    (True, ("kv_both", "kv_both"), "tcp"), (False, ("kv_producer", "kv_consumer"), "jax"),
    (True, ("kv_both", "kv_both"), "jax")])
def test_the_consumer_decodes_the_producers_prefill_computing_only_the_last_prompt_token(
        async_scheduling: bool, roles: tuple[str, str], transport: str) -> None:
    producer, consumer = engines(async_scheduling=async_scheduling, roles=roles,
                                 transport=transport)
    handles = prefill(producer, PROMPTS)
    assert handles["r0"]["remote_num_tokens"] == 41 and handles["r0"]["do_remote_prefill"]
    assert handles["r0"]["remote_transport"] == transport
    # The consumer's prefix cache holds the first 8 tokens of r0: only the rest is fetched.
    consumer.add_request("warm", {"prompt_token_ids": PROMPTS[0][:9]}, params(None, 1))
    while consumer.has_unfinished_requests():
        consumer.step()
    done = decode(consumer, producer, PROMPTS, handles)
    for i, p in enumerate(PROMPTS):
        out = done[f"r{i}"]
        assert list(out.outputs[0].token_ids) == fake_greedy(p, 12, V)
        assert out.num_cached_tokens == len(p) - 1  # local hit + loaded: only the last computed
    c = consumer.state.counters
    assert c.connector_prefix_cache_hits == sum(len(p) for p in PROMPTS) - 8
    # (The fake model's pool is on no mesh, and pulled pages are committed to the device: a
    # process's first "jax" load commits the pool and compiles the scatter and the step once
    # more, device_transport.py; a model's pool, on a mesh, compiles nothing.)
    if transport == "tcp":
        assert consumer.runner.stats.compilations_after_warmup == 0


def test_a_producer_frees_blocks_nobody_picks_up_after_the_timeout_and_refuses_them_then(
        ) -> None:
    producer, consumer = engines(abort_timeout_s=0.3)
    handles = prefill(producer, PROMPTS[:1])
    full = producer.scheduler_config.num_blocks - 1
    assert producer.state.num_free_blocks < full
    deadline = time.monotonic() + 10
    while producer.has_unfinished_requests():  # idle steps wait for a pickup, briefly
        producer.step()
        assert time.monotonic() < deadline
    assert producer.state.num_free_blocks == full
    # A consumer that comes late is refused the pages and recomputes the prompt itself.
    done = decode(consumer, producer, PROMPTS[:1], handles)
    assert list(done["r0"].outputs[0].token_ids) == fake_greedy(PROMPTS[0], 12, V)
    assert done["r0"].num_cached_tokens == 0


def _truncating_producer(page_shape: list[int], dtype: str) -> tuple[int, threading.Thread]:
    """A producer that dies mid-transfer: a valid header, then half the bytes, then gone."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn, server:
            ask = json.loads(conn.makefile("rb").readline())
            n = ask["num_blocks"]
            conn.sendall((json.dumps({"num_pages": n, "page_shape": page_shape,
                                      "dtype": dtype}) + "\n").encode())
            conn.sendall(b"\0" * 8)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


def test_a_producer_that_dies_mid_transfer_or_is_gone_the_consumer_recomputes() -> None:
    producer, consumer = engines()
    handles = prefill(producer, PROMPTS[:2])
    port, thread = _truncating_producer(handles["r0"]["remote_page_shape"],
                                        handles["r0"]["remote_kv_dtype"])
    handles["r0"] = {**handles["r0"], "remote_port": port}
    producer.shutdown()  # r1's producer is gone (its transfer server too): its port refuses
    done = decode(consumer, make_engine(), PROMPTS[:2], handles)
    thread.join(5)
    for i in range(2):
        assert list(done[f"r{i}"].outputs[0].token_ids) == fake_greedy(PROMPTS[i], 12, V)
        assert done[f"r{i}"].num_cached_tokens == 0
    # The producer still holds what nobody picked up (its steps release it on timeout).
    assert producer.state.held_req_ids == {"r0", "r1"}


def test_a_jax_pull_that_never_arrives_is_given_up_and_the_prompt_recomputed() -> None:
    producer, consumer = engines(transport="jax", fetch_timeout_s=0.5)
    handles = prefill(producer, PROMPTS[:2])
    # The pages wait outside the pool: the producer's blocks are free from the next step.
    producer.step()
    assert producer.state.num_free_blocks == producer.scheduler_config.num_blocks - 1
    handles["r0"] = {**handles["r0"], "remote_transfer_id": handles["r0"]["remote_transfer_id"]
                     ^ 1}  # an id nobody offered: its pull never arrives
    done = decode(consumer, producer, PROMPTS[:2], handles)
    for i, cached in enumerate((0, len(PROMPTS[1]) - 1)):
        assert list(done[f"r{i}"].outputs[0].token_ids) == fake_greedy(PROMPTS[i], 12, V)
        assert done[f"r{i}"].num_cached_tokens == cached


def test_a_consumer_aborted_while_its_fetch_runs_frees_its_blocks_once_the_fetch_ends(
        ) -> None:
    producer, consumer = engines(abort_timeout_s=1)  # r0 is never picked up from it
    handles = prefill(producer, PROMPTS[:2])
    server, release = socket.create_server(("127.0.0.1", 0)), threading.Event()

    def stall() -> None:  # a producer that answers only once released, then hangs up
        conn, _ = server.accept()
        with conn, server:
            conn.makefile("rb").readline()
            release.wait(10)

    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    stalled = {**handles["r0"], "remote_port": server.getsockname()[1]}
    consumer.add_request("gone", {"prompt_token_ids": PROMPTS[0]}, params(stalled))
    consumer.step()  # admitted: its fetch starts
    consumer.abort_request("gone")
    consumer.step()
    assert consumer.state.held_req_ids == {"gone"}  # the fetch still writes into its blocks
    release.set()
    done = decode(consumer, producer, PROMPTS[1:2], {"r0": handles["r1"]})
    assert list(done["r0"].outputs[0].token_ids) == fake_greedy(PROMPTS[1], 12, V)
    thread.join(5)


@pytest.mark.parametrize(("change", "message"), [
    ({"remote_block_size": 8}, "the producer's KV pages have block_size 8, this engine's 4"),
    ({"tp_size": 2}, "tp_size 2, this engine's 1"),
    ({"remote_kv_dtype": "bfloat16"}, "dtype 'bfloat16', this engine's 'int32'"),
    ({"remote_num_tokens": 40}, "the producer computed 40 prompt tokens, this prompt has 41"),
    ({"remote_port": None}, "remote_port must be an integer >= 1"),
    ({"nixl_side_channel": 1}, "unknown key.*'nixl_side_channel'"),
    ({"do_remote_decode": True}, "do_remote_decode and do_remote_prefill are both true"),
    ({"remote_transport": "jax"}, "remote_transport 'jax', this engine's transport is 'tcp'"),
])
def test_a_handle_the_consumer_cannot_use_is_refused_before_anything_changes(
        change: dict[str, Any], message: str) -> None:
    producer, consumer = engines()
    handle = {**prefill(producer, PROMPTS[:1])["r0"], **change}
    with pytest.raises(ValueError, match=message):
        consumer.add_request("r0", {"prompt_token_ids": PROMPTS[0]}, params(handle))
    assert not consumer.has_unfinished_requests()


def test_kv_transfer_params_need_the_matching_role() -> None:
    producer, consumer = engines()
    with pytest.raises(ValueError, match="do_remote_decode needs an engine whose .* kv_producer"):
        consumer.add_request("a", [1, 2, 3], params({"do_remote_decode": True}))
    with pytest.raises(ValueError, match="do_remote_prefill needs an engine whose .* kv_consumer"):
        producer.add_request("a", [1, 2, 3], params({"do_remote_prefill": True}))
    with pytest.raises(ValueError, match="kv_transfer_params need an engine started with"):
        make_engine().add_request("a", [1, 2, 3], params({"do_remote_decode": True}))
    # A request that stops before max_tokens has no KV to hand on: freed, no handle.
    producer.add_request("b", [1, 2, 3], SamplingParams(
        max_tokens=4, temperature=0.0, stop_token_ids=[fake_greedy([1, 2, 3], 1, V)[0]],
        extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    outs = [o for _ in range(4) for o in producer.step() if o.finished]
    assert outs[0].kv_transfer_params is None and not producer.has_unfinished_requests()


def test_a_pickup_as_soon_as_the_handle_is_out_gets_the_pools_own_pages() -> None:
    producer, _ = engines()
    handle = prefill(producer, PROMPTS[:1])["r0"]
    blocks = producer.state.kv_transfers.held["r0"].block_ids[:11]  # 41 tokens, 4 a block
    axis = producer.kv_transfer.copier.page_axis
    pool = np.array(producer.runner.kv)  # a copy: a view would keep the pool from donation
    expected = np.moveaxis(np.take(pool, blocks, axis=axis), axis, 0)
    got: dict[str, np.ndarray] = {}
    fetch = threading.Thread(target=lambda: got.update(pages=fetch_pages(
        "127.0.0.1", handle["remote_port"], "r0", first_block=0, num_blocks=11,
        page_shape=tuple(handle["remote_page_shape"]), dtype=np.dtype("int32"),
        timeout_s=10)))
    fetch.start()
    time.sleep(0.2)  # the pickup waits on the server before the producer's next step
    deadline = time.monotonic() + 10
    while fetch.is_alive():
        producer.step()
        assert time.monotonic() < deadline
    np.testing.assert_array_equal(got["pages"], expected)
    assert producer.state.num_free_blocks == producer.scheduler_config.num_blocks - 1
