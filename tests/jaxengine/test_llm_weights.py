"""`LLM.update_weights`: a running engine serves new weights without compiling, on every
data-parallel replica, with its prefix cache emptied; wrong weights and a busy engine are
refused."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxengine import encode_batch, generate, model_fns_of
from jaxengine.engine.args import EngineArgs
from jaxengine.llm import LLM
from jaxengine.replicas.data_parallel import build_engines
from scheduler import SamplingParams

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama_tied_mha"
# Three full blocks of 4 each: cached by the first generate, stale after the update.
PROMPTS = [list(range(3, 16)), list(range(40, 53))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _llm(**engine_args: object) -> LLM:
    """Two replicas on jax's first device; each bucket compiles when a step first needs it."""
    args = EngineArgs(model=str(TINY), skip_tokenizer_init=True, num_gpu_blocks_override=64,
                      max_model_len=64, block_size=4, max_num_seqs=4,
                      max_num_batched_tokens=32, data_parallel_size=2, **engine_args)
    device = jax.devices()[0]
    return LLM.from_engine(build_engines(args, devices=[device, device]))


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_new_weights_are_served_without_compiling_and_without_stale_kv() -> None:
    llm = _llm()
    old = _tokens(llm)  # the prompts' blocks are now in both replicas' prefix caches
    fns, _ = model_fns_of(llm)
    noise = jax.random.normal(jax.random.key(0), (), np.float32)
    new = jax.tree.map(lambda x: x * (1.5 + 0.1 * noise), fns.params)
    ids, lens = encode_batch(None, PROMPTS)
    want = np.asarray(generate(dataclasses.replace(fns, params=new), ids, lens,
                               max_new_tokens=GREEDY.max_tokens, block_size=4).tokens).tolist()
    assert want != old  # the new weights answer differently
    runner = llm.llm_engine.replicas[0].runner
    before = runner.compilations()
    llm.update_weights(new)
    for replica in llm.llm_engine.replicas:
        assert replica.snapshot().free_block_queue() == tuple(range(1, 64))  # nothing cached
        _assert_same(replica.runner.model.params, new)
    assert model_fns_of(llm)[0].params is llm.llm_engine.replicas[0].runner.model.params
    assert _tokens(llm) == want
    assert runner.compilations() == before


def _assert_same(a: object, b: object) -> None:
    """Two pytrees of the same structure hold equal arrays."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_wrong_weights_and_a_busy_engine_are_refused() -> None:
    llm = _llm()
    params = model_fns_of(llm)[0].params
    path = jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(params)[0][0])
    flat, treedef = jax.tree.flatten(params)
    with pytest.raises(ValueError, match=rf"leaf {re.escape(path)} has shape \(1, 2\)"):
        llm.update_weights(jax.tree.unflatten(treedef, [np.zeros((1, 2), np.float32)]
                                              + flat[1:]))
    with pytest.raises(ValueError, match="has dtype int32"):
        llm.update_weights(jax.tree.map(lambda x: x.astype(np.int32), params))
    with pytest.raises(ValueError, match="structure of model_fns_of"):
        llm.update_weights({"embed": flat[0]})
    ids = llm.add_requests({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    with pytest.raises(ValueError, match="1 requests are unfinished"):
        llm.update_weights(params)
    llm.llm_engine.abort_request(ids)
    llm.update_weights(params)  # idle again: taken
    with pytest.raises(ValueError, match="not supported with kv_offloading_size"):
        _llm(kv_offloading_size=0.001).update_weights(params)
