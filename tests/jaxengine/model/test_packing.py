"""Projections packed for the native CPU matmul: the same model, the same outputs, the kernel
in the compiled step, and XLA's dots wherever packing does not apply; int8 models into int8
panels, GGUF Q4_1 / Q8_0 blocks read by the block matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q

from jaxengine.engine.build import model_fns
from jaxengine.loading import load_model
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.packing import (
    BlockEmbedder,
    BlockLinear,
    BlockMLP,
    PackedColumns,
    PackedEmbedder,
    PackedLinear,
    PackedMLP,
    pack_projections,
    packable,
)
from jaxengine.model.quant.gguf import GGUFEmbedder, GGUFLinear
from jaxengine.model.step import RequestChunk, make_model_step, pack_batch, split_model
from jaxengine_kernels.cpu import native
from tests.jaxengine.model.quant.gguf_files import blocks_config, k_m_types, write_blocks_gguf

TARGET = "jaxengine_packed_matmul_f32"
SWIGLU = "jaxengine_packed_swiglu_f32"


def run(model: Model) -> tuple[np.ndarray, np.ndarray, str]:
    """Hidden states of a prefill chunk then a decode, those of the decode step's 15 padding
    rows, and the compiled step's HLO."""
    cfg = model.config
    graphdef, state = split_model(model)
    step = jax.jit(make_model_step(graphdef, attn_impl="cpu"), donate_argnames=("kv",))
    kv = jnp.zeros((cfg.num_layers, 12, 8, 2 * cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 14).tolist()
    out, hlo = [], ""
    for start, n in ((0, 13), (13, 1)):
        chunk = RequestChunk(token_ids=ids[start:start + n], start=start, block_table=[7, 3])
        batch = pack_batch([chunk], num_tokens=16, max_seqs=2, max_blocks=4, block_size=8)
        hlo = hlo or step.lower(state, kv, batch).compile().as_text()
        kv, hidden = step(state, kv, batch)
        out.append(np.asarray(hidden[:n]))
    return np.concatenate(out), np.asarray(hidden[n:]), hlo


@pytest.mark.parametrize("architecture, tied", [("llama", True), ("qwen2", False)])
def test_a_packed_model_computes_what_the_xla_one_does(architecture, tied):
    cfg = ModelConfig.tiny(architecture, tie_word_embeddings=tied, intermediate_size=100)
    want, plain_padding, plain = run(Model(cfg, seed=5))
    model = Model(cfg, seed=5)
    assert packable(model) is None
    assert pack_projections(model) == 7 * cfg.num_layers + 1  # and the LM head
    assert isinstance(model.embed_tokens, PackedEmbedder) == tied
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert isinstance(mlp, PackedMLP) and isinstance(mlp.down_proj, PackedLinear)
    assert isinstance(attn.k_proj, PackedColumns)
    assert attn.q_proj.merged is attn.v_proj.merged  # one product of q/k/v, split by columns
    assert packable(model) == "the projections are packed already"
    assert pack_projections(model) == 0  # a second pass leaves the packed model as it is
    got, padding, packed = run(model)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # The padding rows (token id 0) skip every packed projection: attention gives them zeros,
    # so their residual stream stays token 0's embedding through the layers, where XLA's dots
    # run the MLP on them.
    embedding = model.embed_tokens.encode(jnp.zeros(1, jnp.int32))[0]
    np.testing.assert_allclose(padding, np.broadcast_to(
        np.asarray(model.norm(embedding)), padding.shape), rtol=1e-6)
    assert not np.allclose(plain_padding, padding, rtol=1e-3)
    # Every projection is a kernel in the compiled step: q/k/v one call (XLA's CSE keeps one of
    # the merged product's identical calls), o and down one each, gate/up one SwiGLU call;
    # none is left to XLA.
    assert packed.count(f'custom_call_target="{TARGET}"') == 3 * cfg.num_layers
    assert packed.count(f'custom_call_target="{SWIGLU}"') == cfg.num_layers
    assert plain.count(TARGET) == plain.count(SWIGLU) == 0


def test_a_geglu_model_packs_gate_and_up_as_one_product_and_keeps_its_activation():
    cfg = ModelConfig.tiny("gemma2", hidden_act="gelu_pytorch_tanh", sliding_window=4,
                           layer_types=("sliding_attention", "full_attention"), attn_scale=0.3,
                           attn_softcap=1.0, final_softcap=2.0, tie_word_embeddings=True)
    want, _, _ = run(Model(cfg, seed=5))
    model = Model(cfg, seed=5)
    assert pack_projections(model) == 7 * cfg.num_layers + 1
    mlp = model.layers[0].mlp
    assert isinstance(mlp.gate_proj, PackedColumns) and mlp.gate_proj.merged is mlp.up_proj.merged
    got, _, packed = run(model)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # q/k/v, o, gate/up and down: four packed products a layer, and no SwiGLU call
    assert packed.count(f'custom_call_target="{TARGET}"') == 4 * cfg.num_layers
    assert packed.count(SWIGLU) == 0


@pytest.mark.parametrize("tied", [False, True])
def test_the_engine_functions_pack_and_the_logits_agree(tied):
    cfg = ModelConfig.tiny("qwen2", tie_word_embeddings=tied)
    plain = model_fns(Model(cfg, seed=2), cfg, attn_impl="cpu", pack=False)
    packed = model_fns(Model(cfg, seed=2), cfg, attn_impl="cpu")
    shapes = {leaf.ndim for leaf in jax.tree.leaves(packed.params)}
    assert 3 in shapes and 3 not in {leaf.ndim for leaf in jax.tree.leaves(plain.params)}
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((3, cfg.hidden_size)),
                         jnp.float32)
    np.testing.assert_allclose(np.asarray(packed.compute_logits(packed.params, hidden)),
                               np.asarray(plain.compute_logits(plain.params, hidden)),
                               atol=1e-5, rtol=1e-5)


def test_a_packed_embedding_looks_up_the_tables_rows_and_is_the_tied_head():
    cfg = ModelConfig.tiny(vocab_size=300)  # the last panel part zero columns at any width
    model = Model(cfg, seed=3)
    table = np.asarray(model.embed[...])
    packed = PackedEmbedder(model.embed_tokens)
    ids = jnp.asarray([0, 63, 64, 299, 7, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(packed.encode(ids)), table[np.asarray(ids)])
    hidden = np.random.default_rng(4).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(packed.decode(jnp.asarray(hidden))), hidden @ table.T,
                               rtol=1e-5, atol=1e-5)


def test_packing_applies_only_where_the_kernel_runs():
    cfg = ModelConfig.tiny()
    # Abstract models: the refusals read the layout and dtype, never a weight's values.
    bf16 = nnx.eval_shape(lambda: Model(cfg, dtype=jnp.bfloat16))
    assert packable(bf16) == "packed projections are float32 (the model is bfloat16)"
    assert pack_projections(bf16) == 0
    scanned = nnx.eval_shape(lambda: Model(cfg, scan_layers=True))
    assert packable(scanned) == "packed projections need the looped layer layout " \
                                "(scan_layers=False)"
    assert pack_projections(scanned) == 0


INT8_TARGET, INT8_SWIGLU = "jaxengine_packed_matmul_int8", "jaxengine_packed_swiglu_int8"


def int8_close(got: np.ndarray, want: np.ndarray, *, rtol: float, atol: float) -> None:
    """Packed int8 products against XLA's (x in float32): to `rtol`/`atol`, or where the
    kernel meets x in bfloat16 (`native.int8_pairs`, AVX512-BF16) to bfloat16's rounding of
    x and of the weights, 2^-8 of the largest output (an unscaled or misplaced group would be
    off by the whole output)."""
    if native.int8_pairs():
        rtol, atol = 0.0, 2.0 ** -8 * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("architecture, tied", [("llama", True), ("qwen2", False)])
def test_an_int8_model_packs_into_int8_panels_and_computes_what_its_xla_one_does(architecture,
                                                                                tied):
    # 224 columns: off the AVX2 and AVX-512 panel widths; down contracts 7 groups of 32
    cfg = ModelConfig.tiny(architecture, tie_word_embeddings=tied, intermediate_size=224)
    want, _, _ = run(Model(cfg, seed=5, quantization="int8"))
    model = Model(cfg, seed=5, quantization="int8")
    assert packable(model) is None
    assert pack_projections(model) == 7 * cfg.num_layers + 1
    mlp = model.layers[0].mlp
    assert isinstance(mlp, PackedMLP) and mlp.gate_up.dtype == jnp.int8
    assert isinstance(model.embed_tokens, PackedEmbedder) == tied
    got, _, packed = run(model)
    int8_close(got, want, atol=2e-5, rtol=1e-5)
    # q/k/v, o and down int8 products a layer, gate/up one int8 SwiGLU; no float32 panels
    assert packed.count(f'custom_call_target="{INT8_TARGET}"') == 3 * cfg.num_layers
    assert packed.count(f'custom_call_target="{INT8_SWIGLU}"') == cfg.num_layers
    assert packed.count(TARGET) == packed.count(SWIGLU) == 0


def test_an_int8_packed_embedding_looks_up_and_decodes_as_the_quantized_one():
    cfg = ModelConfig.tiny(vocab_size=300)
    quantized = Model(cfg, seed=3, quantization="int8").embed_tokens
    packed = PackedEmbedder(quantized)
    assert packed.panels.dtype == jnp.int8
    ids = jnp.asarray([0, 63, 64, 299, 7, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(packed.encode(ids)),
                                  np.asarray(quantized.encode(ids)))
    hidden = jnp.asarray(np.random.default_rng(4).standard_normal((5, cfg.hidden_size)),
                         jnp.float32)
    int8_close(np.asarray(packed.decode(hidden)), np.asarray(quantized.decode(hidden)),
               rtol=1e-5, atol=1e-5)


def test_fp8_weights_are_left_to_their_own_modules():
    model = Model(ModelConfig.tiny(), quantization="fp8")
    assert packable(model) == "packed projections are float32, int8 or GGUF Q4_1 / Q8_0 " \
                              "blocks (the weights are float8_e4m3fn)"
    assert pack_projections(model) == 0


BLOCKS, BLOCK_SWIGLU = "jaxengine_block_matmul_q4_1", "jaxengine_block_swiglu_q4_1"


def test_a_gguf_model_reads_its_q4_1_and_q8_0_blocks_natively(tmp_path):
    """Q4_1 projections and a tied Q8_0 embedding as the default model has them: every product
    by the block matmul, the outputs those of the file dequantized to float32."""
    path = tmp_path / "m.gguf"
    write_blocks_gguf(path, blocks_config(), Q.Q4_1, types={"token_embd.weight": Q.Q8_0})
    floats, cfg, _ = load_model(path, with_tokenizer=False)
    want, _, _ = run(floats)
    model, _, _ = load_model(path, with_tokenizer=False, quantization="gguf")
    assert packable(model) is None
    assert pack_projections(model) == 7 * cfg.num_layers + 1
    attn = model.layers[0].self_attn
    assert isinstance(model.layers[0].mlp, BlockMLP) and isinstance(attn.k_proj, PackedColumns)
    assert isinstance(attn.o_proj, BlockLinear) and isinstance(model.embed_tokens, BlockEmbedder)
    got, _, packed = run(model)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    assert packed.count(f'custom_call_target="{BLOCKS}"') == 3 * cfg.num_layers
    assert packed.count(f'custom_call_target="{BLOCK_SWIGLU}"') == cfg.num_layers
    hidden = jnp.asarray(got[:3])
    np.testing.assert_allclose(np.asarray(model.logits(hidden)),
                               np.asarray(floats.logits(hidden)), rtol=1e-5, atol=1e-4)


def test_gguf_types_without_a_native_kernel_keep_their_modules(tmp_path):
    """A Q4_K embedding stays `GGUFEmbedder`, and down projections whose layers mix Q4_1 and
    Q8_0 (llama.cpp's "_M" rule) `GGUFLinear` (the jnp path), beside the Q4_1 ones packed."""
    path = tmp_path / "m.gguf"
    cfg = blocks_config()
    types = {k: t for k, t in k_m_types(cfg, down=(Q.Q4_1, Q.Q8_0)).items() if "ffn_down" in k}
    assert set(types.values()) == {Q.Q4_1, Q.Q8_0}
    write_blocks_gguf(path, cfg, Q.Q4_1, types={**types, "token_embd.weight": Q.Q4_K})
    floats, _, _ = load_model(path, with_tokenizer=False)
    want, _, _ = run(floats)
    model, _, _ = load_model(path, with_tokenizer=False, quantization="gguf")
    assert pack_projections(model) == 6 * cfg.num_layers  # q/k/v, o, gate/up a layer
    assert isinstance(model.layers[0].mlp.down_proj, GGUFLinear)
    assert isinstance(model.embed_tokens, GGUFEmbedder)
    got, _, _ = run(model)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
