"""Whole models with int8 / fp8 weights against float32: the tiny fixtures' logits and their
transformers oracle, looped and scanned layers, the loader's host quantization against a fresh
model's device quantization, the bytes the weights take, and packing leaving fp8 alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.loading import load_model
from jaxengine.loading.hf import SafetensorsSource
from jaxengine.loading.weights import load_weights
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.packing import pack_projections, packable
from jaxengine.model.quant import (
    FORMATS,
    QuantizedEmbedder,
    QuantizedExperts,
    QuantizedLinear,
    quantize_modules,
)
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import TINY_DIRS, PagedRunner, shuffled_table

# These random tiny models have small logit margins and some amplify any error through their
# layers (Gemma 3's six: int8's worst case), so the bounds are what a broken format could not
# meet (a wrong scale or layout agrees on ~1/V of the tokens), not what a real model gets.
AGREEMENT = {"int8": 0.75, "fp8": 0.4}  # top-1 agreement with transformers' float32
MEAN_DLOGPROB = {"int8": 0.2, "fp8": 0.6}  # nat, over each prompt's positions


def _logits(model: Model, ids: list[int]) -> np.ndarray:
    table = shuffled_table(32, -(-len(ids) // 4), seed=0)
    return PagedRunner(model).run([RequestChunk(token_ids=ids, start=0, block_table=table)],
                                  num_tokens=max(16, len(ids)))[0]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


# The default run: one of each kind (GQA, tied with biases, MoE, the most sensitive Gemma);
# the rest, and fp8 past one dense and one MoE model (it shares int8's code past the rounding),
# in the slow run.
QUICK = {("llama3_gqa", "int8"), ("qwen2_bias_tied", "int8"), ("mixtral_moe", "int8"),
         ("gemma3_text", "int8"), ("llama_tied_mha", "fp8"), ("qwen2_moe", "fp8")}
CASES = [pytest.param(p, name, id=f"{p.name}-{name}",
                      marks=() if (p.name, name) in QUICK else pytest.mark.slow)
         for name in ("int8", "fp8") for p in TINY_DIRS]


@pytest.mark.parametrize("path, name", CASES)
def test_every_family_quantized_stays_near_the_transformers_oracle(path, name: str) -> None:
    oracle = np.load(path / "oracle.npz")
    ids, want = oracle["input_ids"].tolist(), oracle["logits"]
    model, _, _ = load_model(str(path), with_tokenizer=False, quantization=name)
    got = _logits(model, ids)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= AGREEMENT[name]
    assert np.abs(_log_softmax(got) - _log_softmax(want)).mean() < MEAN_DLOGPROB[name]


@pytest.mark.parametrize("name", ["llama_tied_mha", "qwen2_moe", "gemma2_softcap"])
def test_looped_and_scanned_layers_and_host_and_device_quantization_agree(name: str) -> None:
    """The loader quantizes on the host in numpy, a float model quantized in place does it
    in jax: the same values; the scanned layout computes the same logits as the looped."""
    path = next(p for p in TINY_DIRS if p.name == name)
    ids = np.load(path / "oracle.npz")["input_ids"].tolist()
    looped, cfg, _ = load_model(str(path), with_tokenizer=False, quantization="int8")
    in_place, _, _ = load_model(str(path), with_tokenizer=False)
    in_place.embed_tokens = quantize_modules(in_place.embed_tokens, FORMATS["int8"])
    in_place.layers = quantize_modules(in_place.layers, FORMATS["int8"])
    if in_place.lm_head is not None:
        in_place.lm_head = quantize_modules(in_place.lm_head, FORMATS["int8"])
    a, b = nnx.to_flat_state(nnx.state(looped)), nnx.to_flat_state(nnx.state(in_place))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (p, x), (_, y) in zip(a, b, strict=True):
        assert x.get_value().dtype == y.get_value().dtype, p
        np.testing.assert_array_equal(np.asarray(x.get_value()).view(np.uint8),
                                      np.asarray(y.get_value()).view(np.uint8), err_msg=str(p))
    source = SafetensorsSource(str(path))
    try:
        weights = load_weights(cfg, source, dtype=jnp.float32, where=str(path),
                               quantization="int8")
    finally:
        source.close()
    scanned = Model(cfg, weights=weights, scan_layers=True, quantization="int8")
    np.testing.assert_allclose(_logits(scanned, ids), _logits(looped, ids), atol=1e-5, rtol=0)


def test_which_weights_are_quantized() -> None:
    """Every projection, the LM head, the embedding and MoE experts; norms, biases and the
    router float."""
    cfg = ModelConfig.tiny("qwen2_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, shared_expert_intermediate_size=32,
                           qkv_bias=True)
    model = Model(cfg, quantization="int8")
    block = model.layers[0]
    assert isinstance(model.embed_tokens, QuantizedEmbedder)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(block.self_attn.q_proj, QuantizedLinear)
    assert block.self_attn.q_proj.bias[...].dtype == jnp.float32  # qwen2's q bias stays float
    assert isinstance(block.moe.experts, QuantizedExperts)
    assert isinstance(block.moe.gate, nnx.Linear)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        router = path[-2] in ("gate", "shared_expert_gate")
        matrix = path[-1] in ("kernel", "embedding", "gate_proj", "up_proj", "down_proj")
        assert (var.get_value().dtype == jnp.int8) == (matrix and not router), path


def _param_bytes(model: Model) -> int:
    return sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_int8_weights_take_at_most_0_35x_the_float32_bytes_tied_embedding_included() -> None:
    cfg = ModelConfig.tiny(vocab_size=512, hidden_size=128, intermediate_size=256,
                           tie_word_embeddings=True)
    f32, int8 = Model(cfg), Model(cfg, quantization="int8")
    ratio = _param_bytes(int8) / _param_bytes(f32)
    assert ratio <= 0.35, ratio
    live = sum(a.nbytes for a in jax.live_arrays() if a.dtype == jnp.int8)
    assert live >= sum(v.get_value().nbytes for _, v in nnx.to_flat_state(
        nnx.state(int8, nnx.Param)) if v.get_value().dtype == jnp.int8)


def test_packing_leaves_an_fp8_model_unpacked() -> None:
    """The packed CPU matmul reads float32 and int8 panels (int8 packing:
    tests/jaxengine/model/test_packing.py): an fp8 model keeps its own modules."""
    model = Model(ModelConfig.tiny(tie_word_embeddings=True), quantization="fp8",
                  scan_layers=False)
    assert packable(model) is not None
    assert pack_projections(model) == 0
    assert isinstance(model.layers[0].self_attn.o_proj, QuantizedLinear)
    assert isinstance(model.embed_tokens, QuantizedEmbedder)


def test_bfloat16_activations_with_int8_weights_stay_near_float32() -> None:
    path = next(p for p in TINY_DIRS if p.name == "llama3_gqa")
    ids = np.load(path / "oracle.npz")["input_ids"].tolist()
    f32, _, _ = load_model(str(path), with_tokenizer=False, quantization="int8")
    bf16, _, _ = load_model(str(path), with_tokenizer=False, quantization="int8",
                            dtype="bfloat16")
    assert bf16.layers[0].mlp.up_proj.kernel_scale[...].dtype == jnp.float32
    assert bf16.layers[0].input_layernorm.scale[...].dtype == jnp.bfloat16
    assert np.abs(_logits(bf16, ids) - _logits(f32, ids)).max() < 0.1
