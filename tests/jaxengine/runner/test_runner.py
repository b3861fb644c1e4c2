"""The runner driven by the real scheduler over the fake model: exact tokens, buckets, compiles."""

from __future__ import annotations

import dataclasses

import chex
import numpy as np
import pytest

from jaxengine.model.fake import fake_greedy, fake_model
from jaxengine.runner.buckets import pick_bucket, request_buckets, token_buckets
from jaxengine.runner.compiles import RecompileError, compile_count
from jaxengine.runner.config import RunnerConfig
from jaxengine.runner.penalty_inputs import WRITE_SLOT_NAME
from jaxengine.runner.runner import Runner
from jaxengine.sampling.rows import SamplingRow
from scheduler import (
    Request,
    SamplingParams,
    SchedulerConfig,
    add_request,
    check_invariants,
    init_state,
    schedule,
    update_from_output,
)

V = 97


def _config(**kw: int) -> RunnerConfig:
    base = dict(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128, block_size=4,
                num_blocks=64, max_logprobs=20, intermediate_token_buckets=False,
                debug_recompiles=False, num_speculative_tokens=0)
    base.update(kw)
    return RunnerConfig(**base)


def _drive(runner: Runner, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    c = runner.config
    state = init_state(SchedulerConfig(
        max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
        max_model_len=c.max_model_len, block_size=c.block_size, num_blocks=c.num_blocks))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        state = add_request(state, Request(request_id=f"r{i}", prompt_token_ids=tuple(p),
                                           sampling_params=sp))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while state.requests:
        state, plan = schedule(state)
        rows = {r: SamplingRow(params=sp, seed=0, position=len(outputs[r]))
                for r in plan.sampling_req_ids}
        sampled = runner.execute(plan, rows)
        state, deltas = update_from_output(state, plan, {r: [t.token_id] for r, t in
                                                         sampled.items()})
        check_invariants(state)
        for d in deltas:
            outputs[d.request_id].extend(d.new_token_ids)
    return outputs


PROMPTS = [[5, 6, 7], list(range(1, 30)), [9] * 11, list(range(40, 47)), [3, 1, 4, 1, 5, 9]]


def test_request_buckets_and_picking() -> None:
    """(Token buckets: test_buckets.py.)"""
    assert request_buckets(128) == (8, 16, 32, 64, 128)
    assert request_buckets(5) == (5,)
    assert pick_bucket((16, 32), 17) == 32
    with pytest.raises(ValueError, match="exceeds"):
        pick_bucket((16, 32), 33)


def test_batched_greedy_equals_single_request_greedy() -> None:
    # budget 32, 4 seqs: chunked prefills of the 29-token prompt mix with decodes of others.
    runner = Runner(fake_model(V), _config())
    outputs = _drive(runner, PROMPTS, max_tokens=9)
    for i, p in enumerate(PROMPTS):
        assert outputs[f"r{i}"] == fake_greedy(p, 9, V)
    assert runner.stats.padded_tokens > 0
    assert runner.stats.computed_tokens == sum(len(p) + 8 for p in PROMPTS)


def test_precompiled_runner_never_compiles_again_and_donates_the_cache() -> None:
    # The runner's jits are built at import, so chex wraps the model's functions, which are
    # traced inside them: once per bucket, plus precompile's eval_shape of the step. A trace
    # after warm-up raises inside the call.
    fake, config = fake_model(V), _config(debug_recompiles=True)
    steps = len(token_buckets(config.max_num_batched_tokens)) + 1
    samplers = len(request_buckets(config.max_num_seqs))
    # compute_logits: once per sampler, and once per step (its prompt-logprobs branch)
    model = dataclasses.replace(fake, step=chex.assert_max_traces(fake.step, n=steps),
                                compute_logits=chex.assert_max_traces(fake.compute_logits,
                                                                      n=samplers + steps))
    runner = Runner(model, config)
    writers = compile_count(WRITE_SLOT_NAME)
    runner.precompile(progress=False)
    # one per bucket: functions no other test uses, so nothing was compiled before; and the
    # penalty-slot writer, which does not depend on the model (an earlier test may have
    # compiled it for these shapes already)
    new_writers = compile_count(WRITE_SLOT_NAME) - writers
    assert new_writers <= 1
    assert runner.stats.compilations == (len(runner.token_buckets)
                                         + len(runner.request_buckets) + new_writers)
    old_kv = runner.kv
    outputs = _drive(runner, PROMPTS, max_tokens=5)
    assert old_kv.is_deleted()  # updated in place
    assert outputs["r1"] == fake_greedy(PROMPTS[1], 5, V)
    assert runner.stats.compilations_after_warmup == 0


def test_debug_flag_raises_on_a_compilation_after_warm_up() -> None:
    # a max_model_len no other test uses: these shapes were never compiled in this process
    runner = Runner(fake_model(V), _config(max_num_batched_tokens=24, max_model_len=124,
                                           debug_recompiles=True))
    runner.mark_warm()  # nothing compiled: the first step must compile, and so raise
    # naming what compiled (the sampler's shapes may be in jit's cache from another test)
    with pytest.raises(RecompileError, match=r"after warm-up in a step of 4 tokens: .*"
                       r"jit\(jaxengine_model_step\) x1 \(\d from the cache\)"):
        _drive(runner, [[1, 2, 3]], max_tokens=2)


def test_padding_tokens_write_only_into_the_null_block() -> None:
    runner = Runner(fake_model(V), _config())
    _drive(runner, [[7] * 5], max_tokens=1)  # 5 tokens padded to 16: 11 padding writes
    kv = np.asarray(runner.kv)
    # the request's two blocks hold its tokens; every other non-null block is untouched
    assert np.count_nonzero(kv[1:]) == 5


def test_steps_that_compile_count_as_compile_time() -> None:
    # shapes no other test uses, so the first steps compile and later ones do not
    runner = Runner(fake_model(V), _config(max_num_batched_tokens=40, max_model_len=132))
    _drive(runner, [[1, 2, 3]], max_tokens=6)
    s = runner.stats
    assert s.compilations >= 1 and s.steps > s.compilations
    compiled = s.compile_seconds
    assert 0 < compiled < s.step_seconds  # some steps compiled, the rest did not
    _drive(runner, [[4, 5, 6]], max_tokens=3)  # same shapes: nothing new to compile
    assert s.compile_seconds == compiled
