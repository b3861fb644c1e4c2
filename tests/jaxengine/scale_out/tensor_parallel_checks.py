"""Tensor-parallel checks on 8 virtual CPU devices (issue 12), run in a child process by
test_tensor_parallel.py: jax must see the devices from its first import, so this module is
not collected by the default run (no `test_` prefix); pytest collects it when it is named on
the command line (`tests/parallel_helpers.py`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine, model_fns
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.fixed_batch.generate import generate
from jaxengine.model.batch import RequestChunk, pack_batch
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.kv_cache import init_kv_cache
from jaxengine.model.mesh import make_mesh
from jaxengine.model.step import make_model_step, split_model
from jaxengine.runner.programs import programs_for
from jaxengine.sampling.logits_processors import build_adjustments
from jaxengine.sampling.rows import build_sampling_metadata
from scheduler import SamplingParams
from tests.jaxengine.scale_out.checkpoints import write_checkpoint

if len(jax.devices()) < 8:
    raise RuntimeError(f"these checks need 8 devices, jax sees {len(jax.devices())}: run them "
                       "through tests/parallel_helpers.py (XLA_FLAGS=--xla_force_host_platform_"
                       "device_count=8)")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
TOL = 1e-4  # float32 logprobs: only the all-reduces' summation order differs
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 1, 4, 1, 5, 9, 2, 6]]
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=7,
                   logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, seed=11, logprobs=0, ignore_eos=True),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> HF directory: GQA with K=2 < tp (8 heads, vocabulary 100: padded for tp=8),
    and the tied-embedding MHA and tied Qwen2 (q/k/v bias, K=2) fixtures (4 heads)."""
    root = tmp_path_factory.mktemp("tp")
    return {
        "gqa_k2": write_checkpoint(root / "gqa_k2", num_heads=8, num_kv_heads=2,
                                   vocab_size=100, tie=False),
        "llama_tied_mha": str(FIXTURES / "llama_tied_mha"),
        "qwen2_bias_tied": str(FIXTURES / "qwen2_bias_tied"),
    }


def engine(model: str | None, tp: int, **kw: object) -> LLMEngine:
    base = dict(model=model, skip_tokenizer_init=True, tensor_parallel_size=tp,
                max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                num_gpu_blocks_override=40, block_size=4)
    return build_engine(EngineArgs(**{**base, **kw}))


def run(e: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
        ) -> dict[str, tuple[list[int], list[dict[int, float]]]]:
    """Every request to the end: request id -> (token ids, per token {id: logprob})."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        e.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = {}
    while e.has_unfinished_requests():
        record_finished(e.step(), done)
    return done


def record_finished(outs: list, done: dict[str, tuple[list[int], list[dict[int, float]]]]
                    ) -> None:
    """Add the finished requests of one step's outputs to `done`, as `run` returns them."""
    for out in outs:
        if out.finished:
            c = out.outputs[0]
            lps = [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs or []]
            done[out.request_id] = (list(c.token_ids), lps)


def assert_same(got: dict, want: dict, where: str) -> None:
    """Same tokens, and every logprob (sampled and top-n) within TOL."""
    assert got.keys() == want.keys()
    for r in want:
        assert got[r][0] == want[r][0], f"{where} request {r}: {got[r][0]} != {want[r][0]}"
        for a, b in zip(got[r][1], want[r][1], strict=True):
            assert a.keys() == b.keys(), f"{where} request {r}: top ids {a} != {b}"
            err = max(abs(a[t] - b[t]) for t in a)
            assert err <= TOL, f"{where} request {r}: logprob differs by {err:.1e}"


@pytest.fixture(scope="module")
def one_device(checkpoints: dict[str, str]) -> Callable[[str], dict]:
    """checkpoint name -> `run` of PROMPTS and PARAMS at tp=1, what every mesh must give;
    each runs once per module (an engine compiles its programs anew)."""
    done: dict[str, dict] = {}

    def want(name: str) -> dict:
        if name not in done:
            done[name] = run(engine(checkpoints[name], 1), PROMPTS, PARAMS)
            assert all(len(t) == 8 for t, _ in done[name].values())
        return done[name]
    return want


# gqa_k2 at tp=8 (K < tp, each KV head repeated on 4 devices) is checked by the precompiled
# engine's test below, on the same prompts; a tied embedding on the mesh by Gemma 2's test
# (tp=2), so the tied fixtures run with -m slow.
@pytest.mark.parametrize(("name", "sizes"), [
    ("gqa_k2", (1, 2)),  # K = tp
    pytest.param("gqa_k2", (1, 4), marks=pytest.mark.slow),
    pytest.param("llama_tied_mha", (1, 2, 4), marks=pytest.mark.slow),
    pytest.param("qwen2_bias_tied", (1, 2, 4), marks=pytest.mark.slow),
])
def test_every_tp_size_gives_the_tokens_and_logprobs_of_one_device(
        checkpoints: dict[str, str], one_device: Callable[[str], dict], name: str,
        sizes: tuple[int, ...]) -> None:
    """Greedy, seeded top-k/top-p/min-p and seeded plain sampling, with logprobs."""
    want = one_device(name)
    for tp in sizes[1:]:
        assert_same(run(engine(checkpoints[name], tp), PROMPTS, PARAMS), want,
                    f"{name} tp={tp}")


def test_preemption_prefix_caching_and_chunked_prefill_under_tp(
        checkpoints: dict[str, str]) -> None:
    """A small pool (preemptions), shared prefixes (cache hits) and a 16-token budget (long
    prompts in chunks): tp=4 with K=2 (replicated KV heads) gives what tp=1 gives."""
    prefix = list(range(40, 64))
    prompts = [prefix + [1, 2], prefix + [3], list(range(1, 30)), prefix + [4, 5, 6]]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)] * 4
    kw = dict(num_gpu_blocks_override=24, max_num_batched_tokens=16)
    results, counters = {}, {}
    for tp in (1, 4):
        e = engine(checkpoints["gqa_k2"], tp, **kw)
        results[tp], counters[tp] = run(e, prompts, params), e.state.counters
    assert counters[4].num_preemptions > 0 and counters[4].prefix_cache_hits > 0
    assert counters[4] == counters[1]  # the scheduler never knows about devices
    assert_same(results[4], results[1], "tp=4 small pool")


@pytest.mark.slow  # 17 s in the child on 2 cores: two engines compile
def test_prompt_logprobs_under_tp_are_one_devices(checkpoints: dict[str, str]) -> None:
    """Prompt logprobs (the step's vocabulary-parallel logits, in 16-token chunks) under
    tp=4 with replicated KV heads: the ids and ranks of tp=1, logprobs within TOL."""
    prompt = list(range(1, 30))
    got = {}
    for tp in (1, 4):
        e = engine(checkpoints["gqa_k2"], tp, max_num_batched_tokens=16)
        e.add_request("a", {"prompt_token_ids": prompt},
                      SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
        while e.has_unfinished_requests():
            for out in e.step():
                got[tp] = out.prompt_logprobs
    assert len(got[1]) == len(prompt) and got[1][0] is None and got[4][0] is None
    for a, b in zip(got[4][1:], got[1][1:], strict=True):
        assert {t: lp.rank for t, lp in a.items()} == {t: lp.rank for t, lp in b.items()}
        assert max(abs(a[t].logprob - b[t].logprob) for t in a) <= TOL


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> HF directory of a random MoE model with 8 heads (K=2) and 8 experts: Mixtral
    (top-2, renormalised) and Qwen2-MoE (top-4, a gated shared expert, layer 1 dense)."""
    root = tmp_path_factory.mktemp("moe")
    common = dict(num_heads=8, num_kv_heads=2, vocab_size=100, num_experts=8,
                  intermediate_size=32)
    return {
        "mixtral": write_checkpoint(root / "mixtral", tie=False, architecture="mixtral",
                                    **common),
        "qwen2_moe": write_checkpoint(root / "qwen2_moe", tie=True, architecture="qwen2_moe",
                                      top_k=4, shared_expert_size=48, mlp_only_layers=(1,),
                                      **common),
    }


def _expert_shards_split(e: LLMEngine, tp: int, expert_parallel: bool) -> int:
    """Assert every routed expert weight is split tp ways (whole experts with expert
    parallelism, each expert's width without); return how many weights were checked."""
    checked = 0
    for path, var in nnx.to_flat_state(e.runner.model.params):
        if "experts" not in path:
            continue
        x = var.get_value()  # [(layers,) E, in, out]
        width = x.ndim - 1 if path[-1] in ("gate_proj", "up_proj") else x.ndim - 2
        axis = x.ndim - 3 if expert_parallel else width
        want = list(x.shape)
        want[axis] //= tp
        assert x.addressable_shards[0].data.shape == tuple(want), (path, x.shape)
        checked += 1
    return checked


@pytest.mark.parametrize(("name", "sizes"), [
    ("mixtral", (1, 8)),
    pytest.param("mixtral", (1, 2, 4), marks=pytest.mark.slow),
    pytest.param("qwen2_moe", (1, 2, 8), marks=pytest.mark.slow),
])
def test_moe_with_and_without_expert_parallelism_gives_one_devices_tokens(
        moe_checkpoints: dict[str, str], name: str, sizes: tuple[int, ...]) -> None:
    """Experts split over tp by width (tensor parallel) or whole (expert parallel): the
    tokens and logprobs of one device, every expert weight really split, and nothing
    compiled after warm-up whatever the routing."""
    want = run(engine(moe_checkpoints[name], 1), PROMPTS, PARAMS)
    for tp in sizes[1:]:
        for ep in (False, True):
            warm = tp == sizes[-1] and ep  # one precompiled engine: every bucket, then none
            e = engine(moe_checkpoints[name], tp, enable_expert_parallel=ep, precompile=warm,
                       debug_recompiles=warm)
            assert_same(run(e, PROMPTS, PARAMS), want, f"{name} tp={tp} ep={ep}")
            assert _expert_shards_split(e, tp, ep) == 3 * 2  # gate/up/down, 2 layers
            assert e.runner.stats.compilations_after_warmup == 0


# Gemma 3 at tp=2 is served to transformers' tokens in the default run by
# test_kv_cache_groups.py (its grouped pool split on the heads), so here it runs with -m slow.
@pytest.mark.parametrize("name", ["gemma2_softcap",
                                  pytest.param("gemma3_text", marks=pytest.mark.slow)])
def test_sliding_window_models_on_the_mesh_give_transformers_tokens(name: str) -> None:
    """Gemma 2 (soft-caps, alternating windows) and Gemma 3 (5:1-style windows, two RoPE
    bases) at tp=2: transformers' greedy tokens past the window, and tp=1's logprobs."""
    oracle = np.load(FIXTURES / name / "oracle.npz")
    prompt = oracle["input_ids"].tolist()
    params = [SamplingParams(max_tokens=len(oracle["greedy_ids"]), temperature=0.0, logprobs=1,
                             ignore_eos=True)]
    got = {tp: run(engine(str(FIXTURES / name), tp, max_num_batched_tokens=16), [prompt],
                   params) for tp in (1, 2)}
    assert got[2]["0"][0] == oracle["greedy_ids"].tolist()
    assert_same(got[2], got[1], f"{name} tp=2")


def test_expert_parallelism_is_refused_for_a_dense_model(checkpoints: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="enable_expert_parallel is for mixture-of-experts "
                                         "models; this llama model has no experts"):
        engine(checkpoints["gqa_k2"], 2, enable_expert_parallel=True)


def test_weights_and_kv_cache_are_split_across_devices(checkpoints: dict[str, str]) -> None:
    """At tp=4 every weight matrix is split four ways (norms replicated); the cache holds 1/2
    of the checkpoint's KV heads per device (K=2: each head on two devices); and the step has
    one all-reduce per row-parallel projection (plus the embedding's), the sampler one
    all-gather of the logits."""
    e = engine(checkpoints["gqa_k2"], 4)
    params = e.runner.model.params
    for path, var in nnx.to_flat_state(params):
        x, name = var.get_value(), ".".join(map(str, path))
        shard = x.addressable_shards[0].data
        assert len(x.addressable_shards) == 4 and len(x.sharding.device_set) == 4, name
        if path[-1] == "scale":  # norms
            assert shard.shape == x.shape, name
        else:
            assert shard.size * 4 == x.size, f"{name}: shard {shard.shape} of {x.shape}"
    kv = e.runner.kv  # [Ly, P, L, 2*K', H], K' = 4 (each of the 2 heads repeated twice)
    assert kv.shape[3] == 8 and kv.addressable_shards[0].data.shape[3] == 2
    assert {s.data.shape for s in kv.addressable_shards} == {(2, 40, 4, 2, 8)}
    layers = e.runner.model.params["layers"]
    batch = pack_batch([], num_tokens=16, max_seqs=4, max_blocks=16, block_size=4)
    no_placeholders = np.full(16, -1, np.int32)
    programs = programs_for(e.runner.model)
    step = programs.step.lower(params, kv, batch, e.runner._no_tokens,
                               no_placeholders).compile()
    assert _collectives(step.as_text()) == {"all-reduce": 2 * len(layers) + 1}
    hidden = step.output_shardings[1]
    hidden = jax.ShapeDtypeStruct((4, 64), np.float32, sharding=hidden)
    t = e.runner.penalties.tables  # penalty tables: replicated, so they add no collective
    sample = programs.sample.lower(params, hidden, np.zeros(4, np.int32),
                                   build_sampling_metadata([], 4),
                                   build_adjustments([], [], [], [], 4), t.bias, t.prompt_mask,
                                   t.output_counts, e.runner._no_tokens, max_logprobs=2,
                                   num_rows=4, token_sharding=e.runner._token_sharding).compile()
    assert _collectives(sample.as_text()) == {"all-gather": 1}


def _collectives(hlo: str) -> dict[str, int]:
    ops = "all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
    return dict(Counter(re.findall(rf"= \S+ ({ops})\(", hlo)))


def test_precompiled_engine_never_compiles_again_and_updates_the_cache_in_place(
        checkpoints: dict[str, str], one_device: Callable[[str], dict]) -> None:
    """tp=8 (vocabulary padded 100 -> 104, KV heads repeated 4x): the tokens and logprobs of
    one device; after precompile the workload compiles nothing (debug_recompiles raises
    otherwise), and every step donates the sharded cache: the old array is deleted, each
    device's buffer is reused."""
    e = engine(checkpoints["gqa_k2"], 8, precompile=True, debug_recompiles=True)
    pointers = [s.data.unsafe_buffer_pointer() for s in e.runner.kv.addressable_shards]
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        e.add_request(str(i), {"prompt_token_ids": p}, sp)
    donated, done = 0, {}
    while e.has_unfinished_requests():
        old = e.runner.kv
        record_finished(e.step(), done)
        # A call that ran the model donated the cache (under async scheduling a call may
        # only collect the step in flight, and then the cache is the same array).
        assert e.runner.kv is old or old.is_deleted()
        donated += e.runner.kv is not old
        assert [s.data.unsafe_buffer_pointer() for s in e.runner.kv.addressable_shards] \
            == pointers
    assert e.runner.stats.compilations_after_warmup == 0 and e.runner.stats.steps > 5
    assert donated - e.runner.stats.steps in (0, 1)  # the last step may still be in flight
    assert_same(done, one_device("gqa_k2"), "gqa_k2 tp=8")


def test_async_scheduling_under_tp_matches_sync_and_compiles_nothing_new(
        checkpoints: dict[str, str], one_device: Callable[[str], dict]) -> None:
    """tp=4 with async scheduling: the placeholders read the sampled tokens where the sampler
    leaves them (replicated on the mesh), through the precompiled programs; the tokens and
    logprobs are one device's synchronous ones."""
    e = engine(checkpoints["gqa_k2"], 4, async_scheduling=True, precompile=True,
               debug_recompiles=True)
    assert_same(run(e, PROMPTS, PARAMS), one_device("gqa_k2"), "tp=4 async")
    assert e.runner.stats.compilations_after_warmup == 0


@pytest.mark.parametrize(("scan_layers", "sizes"), [
    (False, (1, 2)),
    pytest.param(False, (1, 4), marks=pytest.mark.slow),
    pytest.param(True, (1, 2, 4), marks=pytest.mark.slow),
])
def test_generate_under_an_outer_jit_on_a_mesh(scan_layers: bool, sizes: tuple[int, ...]
                                               ) -> None:
    """`jaxengine.generate` over a model split over several devices: the tokens of one device
    (and the same seed gives the same weights on every mesh)."""
    cfg = ModelConfig.tiny("qwen2", num_heads=8, num_kv_heads=2, hidden_size=64,
                           vocab_size=100)
    ids = np.asarray([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5]], np.int32)
    lens = np.asarray([3, 5], np.int32)
    tokens = {}
    for tp in sizes:
        model = Model(cfg, seed=3, mesh=make_mesh(jax.devices()[:tp]), scan_layers=scan_layers)
        fns = model_fns(model, cfg, attn_impl="reference")
        program = jax.jit(lambda params, i, n, fns=fns: generate(
            fns, i, n, max_new_tokens=6, params=params, block_size=4, temperature=0.7,
            key=jax.random.key(1)).tokens)
        tokens[tp] = np.asarray(program(fns.params, ids, lens))
    assert tokens[1].shape == (2, 6)
    for tp in sizes[1:]:
        np.testing.assert_array_equal(tokens[tp], tokens[1])


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_pallas_kernels_run_per_device_under_shard_map(impl: str) -> None:
    """The TPU and GPU kernels (interpret mode) inside the tp=2 step give the reference's
    hidden states and cache at tp=1: each device's kernel sees only its own heads."""
    cfg = ModelConfig.tiny(hidden_size=128, head_dim=64, num_heads=4, num_kv_heads=2)
    chunks = [RequestChunk(token_ids=list(range(3, 3 + n)), start=0, block_table=table)
              for n, table in ((5, [3, 1]), (11, [2, 5, 6]), (1, [4]))]
    batch = pack_batch(chunks, num_tokens=32, max_seqs=4, max_blocks=4, block_size=16)
    out = {}
    for tp, attn in ((1, "reference"), (2, impl)):
        model = Model(cfg, seed=5, mesh=make_mesh(jax.devices()[:tp]))
        graphdef, state = split_model(model)
        kv = init_kv_cache(cfg, num_blocks=8, block_size=16, mesh=model.mesh)
        step = jax.jit(make_model_step(graphdef, attn_impl=attn, interpret=True))
        out[tp] = jax.device_get(step(state, kv, batch))
    np.testing.assert_allclose(out[2][1][:17], out[1][1][:17], atol=TOL)
    # The cache past the null block 0 (where padding tokens write, whatever a kernel does).
    np.testing.assert_allclose(out[2][0][:, 1:], out[1][0][:, 1:], atol=TOL)


@pytest.mark.slow
def test_the_default_model_split_three_ways() -> None:
    """SmolLM2-135M (9 query heads, 3 KV heads; the embedded Q4_1 GGUF) at tp=3: the greedy
    tokens and logprobs of one device."""
    prompts = [[1, 504, 3458, 314], [1, 17, 28, 900, 41, 7]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)] * 2
    kw = dict(model=None, max_model_len=64, num_gpu_blocks_override=24)
    want = run(engine(tp=1, **kw), prompts, params)
    assert_same(run(engine(tp=3, **kw), prompts, params), want, "SmolLM2 tp=3")
