"""`jaxengine.generate`: jit-compiled fixed-batch generation inside an outer `jax.jit`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from jaxengine.generate import generate
from jaxengine.model.fake import fake_greedy, fake_model
from scheduler import SamplingParams

V = 97
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [3, 1, 4, 1, 5]]
TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama_tied_mha"


def _left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    S = max(map(len, prompts))
    ids = np.zeros((len(prompts), S), np.int32)
    for b, p in enumerate(prompts):
        ids[b, S - len(p):] = p
    return ids, np.asarray([len(p) for p in prompts], np.int32)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_greedy_under_an_outer_jit_equals_single_request_greedy(cache: str) -> None:
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)

    @jax.jit
    def research_program(params: dict, ids: jax.Array, lens: jax.Array) -> jax.Array:
        out = generate(model, ids, lens, max_new_tokens=6, params=params, cache=cache,
                       block_size=4)
        return out.tokens

    tokens = np.asarray(research_program(model.params, ids, lens))
    expected = np.asarray([fake_greedy(p, 6, V) for p in PROMPTS], np.int32)  # i32[B, 6]
    chex.assert_trees_all_equal(tokens, expected, strict=True)  # values, shape and dtype


def test_decoding_is_one_loop_not_unrolled() -> None:
    """The decode steps are a `lax.while_loop`: however many tokens, the model step and the
    logits are traced twice each (prefill, then the loop body), never once per token."""
    fake = fake_model(V)
    model = dataclasses.replace(fake, step=chex.assert_max_traces(fake.step, n=2),
                                compute_logits=chex.assert_max_traces(fake.compute_logits, n=2))
    ids, lens = _left_pad(PROMPTS)
    out = jax.jit(lambda i, n: generate(model, i, n, max_new_tokens=20, block_size=4))(ids, lens)
    want = np.asarray([fake_greedy(p, 20, V) for p in PROMPTS], np.int32)  # i32[B, 20]
    chex.assert_trees_all_equal((out.tokens, out.lengths),
                                (want, np.full(len(PROMPTS), 20, np.int32)), strict=True)


def test_eos_stops_a_row_and_pads_it() -> None:
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)
    eos = fake_greedy(PROMPTS[0], 6, V)[2]  # row 0's third token
    out = jax.jit(lambda i, n: generate(model, i, n, max_new_tokens=6, eos_token_id=eos,
                                        pad_id=-1, block_size=4))(ids, lens)
    row = np.asarray(out.tokens[0]).tolist()
    first = fake_greedy(PROMPTS[0], 6, V).index(eos)
    assert row[: first + 1] == fake_greedy(PROMPTS[0], first + 1, V)
    assert row[first + 1:] == [-1] * (5 - first)
    assert int(out.lengths[0]) == first + 1


def test_sampling_is_seeded() -> None:
    model = fake_model(V)
    ids, lens = _left_pad(PROMPTS)
    run = jax.jit(lambda key: generate(model, ids, lens, max_new_tokens=5, key=key,
                                       temperature=50.0, block_size=4).tokens)
    a, b = run(jax.random.key(0)), run(jax.random.key(0))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, run(jax.random.key(1)))


def test_real_tiny_model_matches_the_engine() -> None:
    from jaxengine.engine.build import model_fns
    from jaxengine.llm import LLM
    from jaxengine.loading.load import load_model

    model, cfg, _ = load_model(str(TINY))
    fns = model_fns(model, cfg, attn_impl="reference")
    prompts = [[(5 * b + 3 * j) % 100 + 1 for j in range(n)] for b, n in enumerate((4, 11, 7))]
    ids, lens = _left_pad(prompts)
    out = jax.jit(lambda p, i, n: generate(fns, i, n, max_new_tokens=6, params=p, cache="paged",
                                           block_size=4).tokens)(fns.params, ids, lens)
    llm = LLM(str(TINY), max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
              max_model_len=64, num_gpu_blocks_override=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert np.asarray(out).tolist() == [list(o.outputs[0].token_ids) for o in ref]
