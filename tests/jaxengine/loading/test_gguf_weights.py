"""A GGUF file's weights as blocks: each weight's type, its layers' rows stacked."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxengine.loading.gguf_weights import gguf_weight_types, load_blocks
from jaxengine.loading.weights import model_weight_shapes
from jaxengine.model.config import ModelLoadError
from tests.fixtures.model_helpers import FIXTURES
from tests.jaxengine.loading.test_gguf_file_blocks import _source
from tests.jaxengine.loading.test_load import write_gguf
from tests.jaxengine.model.quant.gguf_files import blocks_config, k_m_types, write_blocks_gguf

Q = gguf.GGMLQuantizationType
Q_PROJ = ("layers", "self_attn", "q_proj", "kernel")


def test_types_and_stacked_rows(tmp_path: Path) -> None:
    cfg = blocks_config()
    write_blocks_gguf(tmp_path / "m.gguf", cfg, Q.Q4_K, types={
        "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K})
    source = _source(tmp_path / "m.gguf")
    types = gguf_weight_types(cfg, source, "m.gguf")
    assert types[Q_PROJ] == (Q.Q4_K,)
    assert types[("layers", "mlp", "down_proj", "kernel")] == (Q.Q6_K,)
    assert types[("embed_tokens", "embedding")] == (Q.Q4_K,)
    assert ("norm", "scale") not in types and ("lm_head", "kernel") not in types  # F32; tied
    shapes = model_weight_shapes(cfg)
    rows, which = load_blocks(Q_PROJ, "model.layers.{layer}.self_attn.q_proj.weight",
                              shapes[Q_PROJ], (Q.Q4_K,), source, "m.gguf")
    assert rows.shape == (2, 256, 144) and which is None
    for layer in range(2):
        want = source.blocks(f"model.layers.{layer}.self_attn.q_proj.weight")[1]
        np.testing.assert_array_equal(rows[layer], want)
    emb, _ = load_blocks(("embed_tokens", "embedding"), "model.embed_tokens.weight",
                         shapes[("embed_tokens", "embedding")], (Q.Q4_K,), source, "m.gguf")
    np.testing.assert_array_equal(emb, source.blocks("model.embed_tokens.weight")[1])


def test_experts_stack_per_layer_and_expert(tmp_path: Path) -> None:
    write_gguf(FIXTURES / "tiny" / "mixtral_moe", tmp_path / "m.gguf", "llama",
               experts_as=Q.Q8_0)
    source = _source(tmp_path / "m.gguf")
    cfg = source._cfg
    types = gguf_weight_types(cfg, source, "m.gguf")
    path = next(p for p in types if p[-1] == "gate_proj")
    assert set(types.values()) == {(Q.Q8_0,)}
    shape = model_weight_shapes(cfg)[path]  # [Ly, E, D, F]
    rows, _ = load_blocks(path, "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1."
                          "weight", shape, (Q.Q8_0,), source, "m.gguf")
    assert rows.shape == (*shape[:2], shape[3], shape[2] // 32 * 34)
    np.testing.assert_array_equal(
        rows[1, 2], source.blocks("model.layers.1.block_sparse_moe.experts.2.w1.weight")[1])


def test_layers_of_mixed_types_share_one_array_of_slots(tmp_path: Path) -> None:
    """llama.cpp's Q4_K_M rule on 4 layers: attn_v Q5_0/Q8_0 and ffn_down Q4_K/Q6_K, the last
    two layers the wider type; each layer's blocks at the start of its slots, zeros after."""
    cfg = blocks_config(num_layers=4)
    types = k_m_types(cfg, v=(Q.Q5_0, Q.Q8_0))
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(4)] == [Q.Q4_K] * 2 + [Q.Q6_K] * 2
    write_blocks_gguf(tmp_path / "m.gguf", cfg, Q.Q4_K, types=types)
    source = _source(tmp_path / "m.gguf")
    down = ("layers", "mlp", "down_proj", "kernel")
    got = gguf_weight_types(cfg, source, "m.gguf")
    assert got[down] == (Q.Q4_K, Q.Q6_K) and got[Q_PROJ] == (Q.Q4_K,)
    assert got[("layers", "self_attn", "v_proj", "kernel")] == (Q.Q5_0, Q.Q8_0)
    rows, which = load_blocks(down, "model.layers.{layer}.mlp.down_proj.weight",
                              model_weight_shapes(cfg)[down], got[down], source, "m.gguf")
    assert rows.shape == (4, 256, 2 * 210) and which.tolist() == [0, 0, 1, 1]
    slots = rows.reshape(4, 256, 2, 210)
    for layer, used in enumerate((144, 144, 210, 210)):
        want = source.blocks(f"model.layers.{layer}.mlp.down_proj.weight")[1]
        np.testing.assert_array_equal(slots[layer, :, :, :used].reshape(256, -1), want)
        assert not slots[layer, :, :, used:].any()


def test_a_weight_partly_float_is_refused_by_name(tmp_path: Path) -> None:
    write_blocks_gguf(tmp_path / "m.gguf", blocks_config(), Q.Q4_K,
                      types={"blk.1.ffn_down.weight": Q.F32})
    with pytest.raises(ModelLoadError, match=r"a weight in blocks in every layer or in none, but "
                       r"model\.layers\.0\.mlp\.down_proj\.weight is Q4_K and "
                       r"model\.layers\.1\.mlp\.down_proj\.weight is float.*quantization=None"):
        gguf_weight_types(blocks_config(), _source(tmp_path / "m.gguf"), "m.gguf")
