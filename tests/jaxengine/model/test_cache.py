"""Cached equivalence and the jit boundary: one full forward equals chunked prefill + paged
decode over shuffled pages (NaN in unused pages must not leak); the donated cache is updated in
place; the step compiles once per token bucket and its program does not grow with depth."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.kv_cache import init_kv_cache, kv_cache_bytes_per_block, kv_cache_shape
from jaxengine.model.step import (
    RequestChunk,
    make_model_step,
    pack_batch,
    split_model,
)
from tests.fixtures.model_helpers import PagedRunner, shuffled_table

TOL = 2e-5


@pytest.fixture(scope="module")
def model() -> Model:
    # Qwen2-style (q/k/v bias) with 4 query heads per kv head; every architecture is checked
    # against transformers in test_model_oracle.py, here the cache plumbing is what varies.
    return Model(ModelConfig.tiny("qwen2", num_kv_heads=1), seed=7)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return np.random.default_rng(3).integers(1, 128, size=21).tolist()


@pytest.fixture(scope="module")
def full_logits(model: Model, prompt: list[int]) -> np.ndarray:
    runner = PagedRunner(model)
    table = list(range(1, 7))
    return runner.run([RequestChunk(token_ids=prompt, start=0, block_table=table)], 32)[0]


@pytest.mark.parametrize("sizes", [[1], [3], [7, 2], [16, 1]], ids=str)
def test_chunked_prefill_and_decode_equal_full_forward(model: Model, prompt: list[int],
                                                       full_logits: np.ndarray,
                                                       sizes: list[int]) -> None:
    runner = PagedRunner(model, fill=np.nan)
    table = shuffled_table(32, 6, seed=sum(sizes))
    got = runner.run_chunked(prompt, sizes, table)
    np.testing.assert_allclose(got, full_logits, atol=TOL, rtol=0)


def test_mixed_batch_of_prefill_chunks_and_decodes(model: Model, prompt: list[int],
                                                   full_logits: np.ndarray) -> None:
    """Three requests share every step: different phases, same answers as alone."""
    runner = PagedRunner(model, num_blocks=40, fill=np.nan)
    tables = [shuffled_table(40, 30, seed=5)[i * 10:(i + 1) * 10] for i in range(3)]
    # request 0 decodes token by token, 1 prefills in chunks of 5, 2 in one go then decodes
    plans = [[1] * 21, [5, 5, 5, 5, 1], [17, 1, 1, 1, 1]]
    got: list[list[np.ndarray]] = [[], [], []]
    pos = [0, 0, 0]
    for step in range(21):
        chunks, live = [], []
        for r in range(3):
            if step < len(plans[r]):
                n = plans[r][step]
                ids = prompt[pos[r]:pos[r] + n]
                chunks.append(RequestChunk(token_ids=ids, start=pos[r], block_table=tables[r]))
                live.append(r)
                pos[r] += n
        for r, logits in zip(live, runner.run(chunks, num_tokens=32), strict=True):
            got[r].append(logits)
    for r in range(3):
        np.testing.assert_allclose(np.concatenate(got[r]), full_logits, atol=TOL, rtol=0)


def test_donated_cache_is_updated_in_place(model: Model) -> None:
    graphdef, state = split_model(model)
    step = jax.jit(make_model_step(graphdef), donate_argnames=("kv",))
    kv = init_kv_cache(model.config, num_blocks=8, block_size=4)
    pointer = kv.unsafe_buffer_pointer()
    batch = pack_batch([RequestChunk(token_ids=[1, 2, 3], start=0, block_table=[2])],
                       num_tokens=16, max_seqs=2, max_blocks=4, block_size=4)
    new_kv, _ = step(state, kv, batch)
    assert kv.is_deleted()
    assert new_kv.unsafe_buffer_pointer() == pointer
    assert float(jnp.abs(new_kv[:, 2, :3]).sum()) > 0  # the three tokens' K/V were written


def test_step_compiles_once_per_token_bucket(model: Model) -> None:
    graphdef, state = split_model(model)
    # Two buckets, so two traces (and compiles); a third trace raises inside the call.
    step = jax.jit(chex.assert_max_traces(make_model_step(graphdef), n=2),
                   donate_argnames=("kv",))
    kv = init_kv_cache(model.config, num_blocks=8, block_size=4)
    sizes = {16: [[5], [1, 1, 1], [16]], 32: [[17], [3, 9]]}
    for num_tokens, requests in sizes.items():
        for lens in requests:
            chunks = [RequestChunk(token_ids=[1] * n, start=0, block_table=[1, 2, 3, 4, 5])
                      for n in lens]
            kv, _ = step(state, kv, pack_batch(chunks, num_tokens=num_tokens, max_seqs=4,
                                               max_blocks=5, block_size=4))


def test_step_scratch_memory_does_not_grow_with_num_blocks(model: Model) -> None:
    """The kernel works on the donated cache in place: no per-layer copy of its pages (a
    slice-and-write-back design needed [P, L, 2K, H] of scratch: 233 KB -> 749 KB here)."""
    graphdef, state = split_model(model)
    step = jax.jit(make_model_step(graphdef), donate_argnames=("kv",))
    batch = pack_batch([], num_tokens=16, max_seqs=2, max_blocks=4, block_size=4)

    def scratch_bytes(num_blocks: int) -> int:
        shape = kv_cache_shape(model.config, num_blocks=num_blocks, block_size=4)
        kv = jax.ShapeDtypeStruct(shape, jnp.float32)
        return step.lower(state, kv, batch).compile().memory_analysis().temp_size_in_bytes

    assert scratch_bytes(16) == scratch_bytes(1024)


def test_program_size_does_not_grow_with_depth() -> None:
    """With `scan_layers=True` (the accelerator default) layers are a scan, not unrolled."""

    def jaxpr_len(num_layers: int) -> int:
        # The weights' shapes are all a trace needs: drawing them would compile their init.
        model = nnx.eval_shape(lambda: Model(ModelConfig.tiny(num_layers=num_layers), seed=0,
                                             scan_layers=True))
        graphdef, state = split_model(model)
        kv = init_kv_cache(model.config, num_blocks=4, block_size=4)
        batch = pack_batch([], num_tokens=16, max_seqs=2, max_blocks=2, block_size=4)
        jaxpr = jax.make_jaxpr(make_model_step(graphdef))(state, kv, batch)
        return len(re.sub(r"\d+", "", str(jaxpr)))  # sizes (digits) differ, structure not

    assert jaxpr_len(2) == jaxpr_len(5)


def test_looped_and_scanned_layers_agree() -> None:
    """The CPU default loops over per-layer weights; it computes what the scan computes."""
    cfg = ModelConfig.tiny("qwen3", num_layers=3)
    assert not Model(cfg, seed=1).scan_layers  # CPU picks the loop
    table = shuffled_table(8, 2, seed=2)  # 5 tokens on pages of 4
    batch = pack_batch([RequestChunk(token_ids=[5, 9, 2, 11, 7], start=0, block_table=table)],
                       num_tokens=16, max_seqs=2, max_blocks=4, block_size=4)
    results = []
    for scan in (False, True):
        graphdef, state = split_model(Model(cfg, seed=1, scan_layers=scan))
        kv = init_kv_cache(cfg, num_blocks=8, block_size=4)
        results.append(jax.jit(make_model_step(graphdef))(state, kv, batch))
    (kv_loop, h_loop), (kv_scan, h_scan) = results
    np.testing.assert_allclose(np.asarray(h_loop)[:5], np.asarray(h_scan)[:5], atol=TOL)
    np.testing.assert_allclose(np.asarray(kv_loop), np.asarray(kv_scan), atol=TOL)
    assert np.abs(np.asarray(kv_loop)).sum() > 0  # the step wrote the cache


def test_given_weights_fill_either_layout_by_module_path() -> None:
    """`Model(weights=...)` takes arrays by module path in the scanned layout (as the loader
    returns them); looped layers take their slices; a missing or misshapen one is an error."""
    cfg = ModelConfig.tiny("qwen2", num_layers=2)
    source = Model(cfg, seed=4, scan_layers=True)
    weights = {path: var.get_value()
               for path, var in nnx.to_flat_state(nnx.state(source, nnx.Param))}
    batch = pack_batch([RequestChunk(token_ids=[3, 1, 4, 1, 5], start=0, block_table=[2, 5])],
                       num_tokens=16, max_seqs=2, max_blocks=4, block_size=4)

    def hidden(model: Model) -> np.ndarray:
        graphdef, state = split_model(model)
        kv = init_kv_cache(cfg, num_blocks=8, block_size=4)
        return np.asarray(jax.jit(make_model_step(graphdef))(state, kv, batch)[1])[:5]

    expected = hidden(source)
    for scan in (False, True):
        np.testing.assert_allclose(hidden(Model(cfg, weights=weights, scan_layers=scan)),
                                   expected, atol=TOL, rtol=0)
    bad = {**weights, ("layers", "mlp", "up_proj", "kernel"): np.zeros((2, 32, 7), np.float32)}
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.kernel: shape \(32, 7\)"):
        Model(cfg, weights=bad, scan_layers=False)
    del bad[("layers", "mlp", "up_proj", "kernel")]
    with pytest.raises(ValueError, match=r"weight layers\.mlp\.up_proj\.kernel is missing"):
        Model(cfg, weights=bad, scan_layers=True)


def test_kv_cache_helpers() -> None:
    cfg = ModelConfig.smollm2_135m()
    assert kv_cache_shape(cfg, num_blocks=10, block_size=16) == (30, 10, 16, 6, 64)
    # 30 layers * 6 head slots * 64 * 16 tokens * 2 bytes = 368 640 bytes per bf16 page
    assert kv_cache_bytes_per_block(cfg, block_size=16, dtype=jnp.bfloat16) == 368_640
    assert kv_cache_bytes_per_block(cfg, block_size=16, dtype=jnp.float32) == 2 * 368_640


def test_pack_batch_layout_and_errors() -> None:
    chunks = [RequestChunk(token_ids=[7, 8, 9], start=4, block_table=[5, 3]),
              RequestChunk(token_ids=[6], start=0, block_table=[2])]
    b = pack_batch(chunks, num_tokens=8, max_seqs=3, max_blocks=4, block_size=4)
    assert b.input_ids.tolist() == [7, 8, 9, 6, 0, 0, 0, 0]
    assert b.positions.tolist()[:4] == [4, 5, 6, 0]
    assert b.slot_mapping.tolist() == [12, 13, 14, 8, 0, 0, 0, 0]
    assert b.seq_lens.tolist() == [7, 1, 0]
    assert b.query_start_loc.tolist() == [0, 3, 4, 4]
    assert b.logits_indices.tolist()[:2] == [2, 3]
    assert int(b.num_seqs) == 2
    with pytest.raises(ValueError, match="exceed the bucket"):
        pack_batch(chunks, num_tokens=2, max_seqs=3, max_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="does not fit"):
        pack_batch([RequestChunk(token_ids=[1] * 9, start=0, block_table=[1, 2])],
                   num_tokens=16, max_seqs=3, max_blocks=4, block_size=4)
