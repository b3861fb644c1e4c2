"""KV cache groups of a model (jaxengine/model/kv_groups.py): vLLM's grouping, the pool's
layout and the batch that carries every group's tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.loading.hf import SafetensorsSource, read_hf_config
from jaxengine.loading.weights import load_weights
from jaxengine.model.batch import RequestChunk, pack_batch, requests_of_step
from jaxengine.model.config import FULL, SLIDING, ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.kv_cache import kv_cache_bytes_per_block, kv_cache_shape
from jaxengine.model.kv_groups import kv_cache_layout
from jaxengine.model.step import make_compute_logits, make_model_step, split_model
from scheduler.kv.groups import KVCacheGroup
from tests.fixtures.model_helpers import TINY_DIRS


def _config(types: tuple[str, ...] | None, window: int | None = 8) -> ModelConfig:
    return ModelConfig.tiny("gemma3_text", num_layers=len(types or (FULL,) * 6),
                            sliding_window=window, layer_types=types)


def test_full_attention_is_one_group_of_every_layer_in_todays_layout():
    cfg = _config(None, window=None)
    layout = kv_cache_layout(cfg)
    assert layout.groups == (KVCacheGroup(num_layers=6),)
    assert layout.layer_group == (0,) * 6 and layout.layer_slot == tuple(range(6))
    flat = kv_cache_shape(cfg, num_blocks=9, block_size=4)
    assert kv_cache_shape(cfg, num_blocks=9, block_size=4, grouped=True) == flat == (
        6, 9, 4, 4, 8)


def test_gemma3_five_local_to_one_global_is_one_full_and_five_sliding_groups():
    cfg = _config((SLIDING,) * 5 + (FULL,))
    layout = kv_cache_layout(cfg)
    assert layout.groups == (KVCacheGroup(num_layers=1),) + (
        KVCacheGroup(sliding_window=8, num_layers=1),) * 5
    assert layout.layer_group == (1, 2, 3, 4, 5, 0) and layout.layer_slot == (0,) * 6
    # A page holds one layer: the same bytes give six times the pages.
    assert kv_cache_shape(cfg, num_blocks=9, block_size=4, grouped=True) == (1, 9, 4, 4, 8)
    one = kv_cache_bytes_per_block(cfg, block_size=4, dtype=np.float32, grouped=True)
    assert 6 * one == kv_cache_bytes_per_block(cfg, block_size=4, dtype=np.float32)


@pytest.mark.parametrize("types, groups, layer_group, layer_slot", [
    # Gemma 2, 1 : 1 -> one group of each kind, two layers each.
    ((SLIDING, FULL) * 2, (None, 8), (1, 0, 1, 0), (0, 0, 1, 1)),
    # The gemma3_text fixture's 2 : 1 in 6 layers -> groups of the 2 full layers.
    ((SLIDING, SLIDING, FULL) * 2, (None, 8, 8), (1, 1, 0, 2, 2, 0), (0, 1, 0, 0, 1, 1)),
    # Qwen2 with max_window_layers=1 -> 1 full, 2 sliding groups of one layer.
    ((FULL, SLIDING, SLIDING), (None, 8, 8), (0, 1, 2), (0, 0, 0)),
    # Mistral, every layer slides -> one sliding group of all of them.
    (None, (8,), (0, 0), (0, 1)),
    # 3 sliding, 2 full: 3 < 1.25 * 2, so groups of 2 and the last sliding one padded.
    ((SLIDING, FULL, SLIDING, FULL, SLIDING), (None, 8, 8), (1, 0, 1, 0, 2), (0, 0, 1, 1, 0)),
])
def test_vllm_grouping(types, groups, layer_group, layer_slot):
    cfg = (_config(types) if types else
           ModelConfig.tiny("mistral", sliding_window=8))
    layout = kv_cache_layout(cfg)
    assert tuple(g.sliding_window for g in layout.groups) == groups
    assert len({g.num_layers for g in layout.groups}) == 1
    assert layout.layer_group == layer_group and layout.layer_slot == layer_slot


def test_a_batch_carries_each_groups_tables_and_slots():
    chunks = [RequestChunk(token_ids=[5, 6], start=8, block_table=[3, 4, 7],
                           group_block_tables=[[3, 4, 7], [0, 2, 1]]),
              RequestChunk(token_ids=[9], start=0, block_table=[5],
                           group_block_tables=[[5], [6]])]
    batch = pack_batch(chunks, num_tokens=4, max_seqs=3, max_blocks=3, block_size=4,
                       num_groups=2)
    np.testing.assert_array_equal(batch.group_block_tables[1], [[0, 2, 1], [6, 0, 0],
                                                                [0, 0, 0]])
    np.testing.assert_array_equal(batch.group_block_tables[0], batch.block_tables)
    # token 8 of the first request is offset 0 of its third page: 7 in group 0, 1 in group 1
    np.testing.assert_array_equal(batch.group_slot_mapping, [[28, 29, 20, 0], [4, 5, 24, 0]])
    np.testing.assert_array_equal(batch.group_slot_mapping[0], batch.slot_mapping)
    cut = requests_of_step(pack_batch(chunks, num_tokens=4, max_seqs=8, max_blocks=3,
                                      block_size=4, num_groups=2))
    assert cut.group_block_tables.shape == (2, 4, 3)
    assert pack_batch(chunks, num_tokens=4, max_seqs=3, max_blocks=3,
                      block_size=4).group_block_tables is None


def test_a_chunk_without_every_groups_table_is_refused():
    chunk = RequestChunk(token_ids=[1], start=0, block_table=[2])
    with pytest.raises(ValueError, match="block tables for 2 KV cache groups"):
        pack_batch([chunk], num_tokens=4, max_seqs=2, max_blocks=2, block_size=4, num_groups=2)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_grouped_cache_with_slid_out_pages_gives_transformers_logits(scan_layers):
    """gemma3_text (a full and two sliding groups of two layers) on a pool in the groups'
    layout, NaN where nothing was written: each group has its own shuffled pages, and a
    sliding group's pages that left the window are the null block 0, as the scheduler
    hands them out; both layer layouts (looped, scanned) read their group's."""
    path = TINY_DIRS[[p.name for p in TINY_DIRS].index("gemma3_text")]
    oracle = np.load(path / "oracle.npz")
    cfg = read_hf_config(str(path))
    source = SafetensorsSource(str(path))
    try:
        weights = load_weights(cfg, source, dtype=jnp.float32, where=str(path))
    finally:
        source.close()
    model = Model(cfg, weights=weights, scan_layers=scan_layers)
    layout = kv_cache_layout(cfg)
    assert len(layout.groups) == 3 and layout.num_slots == 2
    graphdef, state = split_model(model)
    step = jax.jit(make_model_step(graphdef))
    logits_fn = jax.jit(make_compute_logits(graphdef))
    kv = jnp.full(kv_cache_shape(cfg, num_blocks=40, block_size=4, grouped=True), jnp.nan)
    pages = np.random.default_rng(0).permutation(np.arange(1, 40))[:30].reshape(3, 10)
    ids, got, start = oracle["input_ids"].tolist(), [], 0
    for n in (16, 16, 8):
        skipped = max(0, start - 8 + 1) // 4  # blocks the step's first query cannot see
        tables = [list(pages[g]) if layout.groups[g].sliding_window is None
                  else [0] * skipped + list(pages[g][skipped:]) for g in range(3)]
        chunk = RequestChunk(token_ids=ids[start:start + n], start=start,
                             block_table=tables[0], group_block_tables=tables)
        batch = pack_batch([chunk], num_tokens=16, max_seqs=2, max_blocks=10, block_size=4,
                           num_groups=3)
        kv, hidden = step(state, kv, batch)
        got.append(np.asarray(logits_fn(state, hidden))[:n])
        start += n
    np.testing.assert_allclose(np.concatenate(got), oracle["logits"], atol=1e-4, rtol=0)
