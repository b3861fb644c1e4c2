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
from tests.jaxengine.model.quant.gguf_files import blocks_config, write_blocks_gguf

Q = gguf.GGMLQuantizationType
Q_PROJ = ("layers", "self_attn", "q_proj", "kernel")


def test_types_and_stacked_rows(tmp_path: Path) -> None:
    cfg = blocks_config()
    write_blocks_gguf(tmp_path / "m.gguf", cfg, Q.Q4_K, types={
        "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K})
    source = _source(tmp_path / "m.gguf")
    types = gguf_weight_types(cfg, source, "m.gguf")
    assert types[Q_PROJ] == Q.Q4_K and types[("layers", "mlp", "down_proj", "kernel")] == Q.Q6_K
    assert types[("embed_tokens", "embedding")] == Q.Q4_K
    assert ("norm", "scale") not in types and ("lm_head", "kernel") not in types  # F32; tied
    shapes = model_weight_shapes(cfg)
    rows = load_blocks(Q_PROJ, "model.layers.{layer}.self_attn.q_proj.weight", shapes[Q_PROJ],
                       Q.Q4_K, source, "m.gguf")
    assert rows.shape == (2, 256, 144)
    for layer in range(2):
        want = source.blocks(f"model.layers.{layer}.self_attn.q_proj.weight")[1]
        np.testing.assert_array_equal(rows[layer], want)
    emb = load_blocks(("embed_tokens", "embedding"), "model.embed_tokens.weight",
                      shapes[("embed_tokens", "embedding")], Q.Q4_K, source, "m.gguf")
    np.testing.assert_array_equal(emb, source.blocks("model.embed_tokens.weight")[1])


def test_experts_stack_per_layer_and_expert(tmp_path: Path) -> None:
    write_gguf(FIXTURES / "tiny" / "mixtral_moe", tmp_path / "m.gguf", "llama",
               experts_as=Q.Q8_0)
    source = _source(tmp_path / "m.gguf")
    cfg = source._cfg
    types = gguf_weight_types(cfg, source, "m.gguf")
    path = next(p for p in types if p[-1] == "gate_proj")
    assert set(types.values()) == {Q.Q8_0}
    shape = model_weight_shapes(cfg)[path]  # [Ly, E, D, F]
    rows = load_blocks(path, "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
                       shape, Q.Q8_0, source, "m.gguf")
    assert rows.shape == (*shape[:2], shape[3], shape[2] // 32 * 34)
    np.testing.assert_array_equal(
        rows[1, 2], source.blocks("model.layers.1.block_sparse_moe.experts.2.w1.weight")[1])


def test_a_weight_of_mixed_types_is_refused_by_name(tmp_path: Path) -> None:
    write_blocks_gguf(tmp_path / "m.gguf", blocks_config(), Q.Q4_K,
                      types={"blk.1.ffn_down.weight": Q.Q6_K})
    with pytest.raises(ModelLoadError, match=r"one type, but model\.layers\.0\.mlp\.down_proj"
                       r"\.weight is Q4_K and model\.layers\.1\.mlp\.down_proj\.weight is "
                       r"Q6_K.*quantization=None"):
        gguf_weight_types(blocks_config(), _source(tmp_path / "m.gguf"), "m.gguf")
