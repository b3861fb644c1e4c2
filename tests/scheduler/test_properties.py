"""Property-based tests on random traces: invariants after every step, every request finishes,
every block returns to the pool, and old states stay valid: the same calls give the same results."""

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import (
    LoRARequest,
    Request,
    SamplingParams,
    SchedulerConfig,
    abort_requests,
    add_request,
    check_invariants,
    init_state,
    schedule,
    update_from_output,
)
from scheduler.kv.kv_cache import cdiv

EOS = 3
ADAPTERS = tuple(LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("xyz", 1))


@st.composite
def configs(draw) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 64))
    max_num_seqs = draw(st.integers(1, 8))
    chunked = draw(st.booleans())
    low = max(max_num_seqs, 1 if chunked else max_model_len)
    budget = draw(st.integers(low, max(low, min(128, max_num_seqs * max_model_len))))
    partial = draw(st.sampled_from([1, 1, 2, 3])) if chunked else 1
    return SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=min(max_model_len, draw(st.sampled_from([0, 0, 1, 4, 16]))),
        max_num_partial_prefills=partial,
        max_long_partial_prefills=draw(st.integers(1, partial)),
        policy=draw(st.sampled_from(["fcfs", "priority", "srpf"])),
        block_size=block_size,
        num_blocks=cdiv(max_model_len, block_size) + 1 + draw(st.integers(0, 24)),
        enable_prefix_caching=draw(st.booleans()),
        reserve_full_prompt=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1])),
        max_loras=draw(st.sampled_from([None, None, 1, 2])),
    )


@st.composite
def traces(draw):
    cfg = draw(configs())
    shared = draw(st.lists(st.integers(10, 13), min_size=1, max_size=cfg.max_model_len - 1))
    requests = []
    for i in range(draw(st.integers(1, 12))):
        n = draw(st.integers(1, cfg.max_model_len - 1))
        own = draw(st.lists(st.integers(10, 40), min_size=n, max_size=n))
        prompt = (shared + own)[:n] if draw(st.booleans()) else own
        requests.append((draw(st.integers(0, 8)), Request(
            request_id=f"r{i}", prompt_token_ids=tuple(prompt),
            sampling_params=SamplingParams(max_tokens=draw(st.integers(1, 20)),
                                           ignore_eos=draw(st.booleans())),
            arrival_time=float(i), priority=draw(st.integers(0, 3)), eos_token_id=EOS,
            cache_salt=draw(st.sampled_from([None, None, "s"])),
            lora_request=draw(st.sampled_from((None, None) + ADAPTERS)) if cfg.max_loras else None,
        )))
    return cfg, requests, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_keep_invariants_and_return_every_block(trace):
    cfg, requests, seed = trace
    rng = random.Random(seed)
    s = init_state(cfg)
    pending = sorted(requests, key=lambda x: (x[0], x[1].arrival_time))
    for step in range(3000):
        while pending and pending[0][0] <= step:
            s = add_request(s, pending.pop(0)[1])
        if not pending and not s.requests:
            break
        if rng.random() < 0.03 and s.requests:
            s = abort_requests(s, [rng.choice(sorted(s.requests))])
        check_purity = rng.random() < 0.2
        s2, out = schedule(s)
        check_invariants(s2, out)
        if out.preempted_req_ids:
            event("preempted")
        sampled, drafts = _fake_model(rng, out, s2)
        stopped = {rid: "stop" for rid in sampled if rng.random() < 0.05}  # by the detokenizer
        s3, deltas = update_from_output(s2, out, sampled, draft_token_ids=drafts, stopped=stopped)
        check_invariants(s3)
        if check_purity:  # s and s2 are intact after the calls on them (and on s3)
            again, out_again = schedule(s)
            assert out_again == out and again == s2
            assert update_from_output(s2, out, sampled, draft_token_ids=drafts,
                                      stopped=stopped) == (s3, deltas)
        for d in deltas:
            assert len(d.new_token_ids) <= len(sampled[d.request_id])
            if d.request_id in stopped:
                assert (d.finish_reason, d.stop_reason) == ("stop", "stop")
                assert d.request_id not in s3.requests
        s = s3
    else:
        raise AssertionError("requests did not all finish in 3000 steps")
    assert not s.requests and not s.running and not s.waiting  # every request finished
    assert s.num_free_blocks == cfg.num_blocks - 1
    assert s.stats.kv_cache_usage == 0.0


def _fake_model(rng, out, state):
    """Samples for requests whose prompt is complete: 1 token, or 1 + accepted drafts."""
    sampled = {}
    for rid in out.sampling_req_ids:
        drafts = out.scheduled_spec_decode_tokens.get(rid, ())
        accepted = rng.randint(0, len(drafts))
        sampled[rid] = list(drafts[:accepted]) + [rng.choice([EOS, 20, 21, 22])]
    drafts = {rid: [rng.randint(10, 40) for _ in range(rng.randint(1, 3))]
              for rid in state.running if rng.random() < 0.1}
    return sampled, drafts
