"""`GGUFSource.blocks`: a quantized tensor's bytes as the file holds them, under HF names."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxengine.loading.gguf_file import GGUFSource, gguf_metadata, open_gguf, read_gguf_config
from jaxengine.model.config import ModelLoadError
from tests.fixtures.model_helpers import FIXTURES
from tests.jaxengine.loading.test_load import write_gguf
from tests.jaxengine.model.quant.gguf_files import blocks_config, write_blocks_gguf

Q = gguf.GGMLQuantizationType


def _source(path: Path) -> GGUFSource:
    reader = open_gguf(str(path))
    return GGUFSource(reader, read_gguf_config(reader, gguf_metadata(reader)), str(path))


def test_blocks_are_the_rows_get_dequantizes(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_blocks_gguf(path, blocks_config(), Q.Q4_K, types={"blk.1.attn_q.weight": Q.Q8_0,
                                                           "blk.0.ffn_down.weight": Q.Q6_K})
    source = _source(path)
    for name, qtype in [("model.layers.1.self_attn.q_proj.weight", Q.Q8_0),  # Q/K: unpermuted
                        ("model.layers.0.self_attn.k_proj.weight", Q.Q4_K),
                        ("model.layers.0.mlp.down_proj.weight", Q.Q6_K),
                        ("model.embed_tokens.weight", Q.Q4_K)]:
        got_type, rows = source.blocks(name)
        assert got_type == qtype and rows.dtype == np.uint8
        np.testing.assert_array_equal(gguf.quants.dequantize(rows, qtype), source.get(name))
    assert source.blocks("model.layers.0.input_layernorm.weight") is None  # F32: a float
    assert source.blocks("lm_head.weight") is None  # tied: not in the file


def test_an_expert_is_its_slice_of_the_stack(tmp_path: Path) -> None:
    write_gguf(FIXTURES / "tiny" / "mixtral_moe", tmp_path / "m.gguf", "llama",
               experts_as=Q.Q8_0)
    source = _source(tmp_path / "m.gguf")
    name = "model.layers.1.block_sparse_moe.experts.{}.w1.weight"
    rows = [source.blocks(name.format(e)) for e in range(2)]
    assert rows[0][0] == Q.Q8_0 and not np.array_equal(rows[0][1], rows[1][1])
    for e, (qtype, r) in enumerate(rows):
        np.testing.assert_array_equal(gguf.quants.dequantize(r, qtype),
                                      source.get(name.format(e)))


def test_a_type_without_a_dequantizer_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_blocks_gguf(path, blocks_config(), Q.Q8_0, types={"blk.0.ffn_up.weight": Q.TQ2_0})
    source = _source(path)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_up\.weight is TQ2_0, which "
                       r"quantization='gguf' does not serve.*supported: Q4_0, Q4_1, Q5_0, Q5_1, "
                       r"Q8_0, Q4_K, Q5_K, Q6_K.*quantization=None"):
        source.blocks("model.layers.0.mlp.up_proj.weight")
