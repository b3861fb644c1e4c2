"""ModelConfig: read from HF config.json and GGUF metadata, validated with clear messages."""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine.model.config import ModelConfig, ModelLoadError, RopeScaling
from jaxengine.model.layers import rope_inv_freq
from tests.fixtures.model_helpers import FIXTURES, load_json


def hf(name: str) -> dict:
    return load_json(FIXTURES / "tiny" / name / "config.json")


def test_reads_each_architecture_from_hf_config() -> None:
    llama3 = ModelConfig.from_hf_config(hf("llama3_gqa"))
    assert (llama3.architecture, llama3.num_heads, llama3.num_kv_heads) == ("llama", 4, 2)
    assert llama3.rope_scaling == RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0,
                                              original_max_position_embeddings=64)
    assert not llama3.tie_word_embeddings
    tied = ModelConfig.from_hf_config(hf("llama_tied_mha"))
    assert tied.tie_word_embeddings and tied.num_kv_heads == 4 and tied.num_layers == 3
    mistral = ModelConfig.from_hf_config(hf("mistral_gqa"))
    assert mistral.architecture == "mistral" and mistral.rope_theta == 1e6
    qwen2 = ModelConfig.from_hf_config(hf("qwen2_bias_tied"))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf_config(hf("qwen3_qknorm"))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16


def test_old_style_rope_fields() -> None:
    cfg = dict(hf("llama3_gqa"), rope_theta=5e5,
               rope_scaling=dict(type="linear", factor=2.0))
    del cfg["rope_parameters"]
    parsed = ModelConfig.from_hf_config(cfg)
    assert parsed.rope_theta == 5e5 and parsed.rope_scaling.kind == "linear"
    inv = rope_inv_freq(8, 5e5, parsed.rope_scaling)
    np.testing.assert_allclose(inv, rope_inv_freq(8, 5e5, None) / 2, rtol=1e-6)


def test_unsupported_architecture_is_named() -> None:
    cfg = dict(hf("llama3_gqa"), model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_config(cfg)
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "falcon"}, tied=True)


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "'yarn' is not supported"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_key_value_heads=3), "num_heads=4 must be a multiple of num_kv_heads=3"),
    (dict(hidden_size=0), "hidden_size must be > 0, got 0"),
])
def test_invalid_configs_say_what_is_wrong(change: dict, message: str) -> None:
    cfg = dict(hf("llama3_gqa"), **change)
    cfg.pop("head_dim") if "hidden_size" in change else None
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_config(cfg)


def test_missing_field_is_named() -> None:
    cfg = hf("mistral_gqa")
    del cfg["intermediate_size"]
    with pytest.raises(ModelLoadError, match="'intermediate_size'"):
        ModelConfig.from_hf_config(cfg)


def test_gguf_metadata() -> None:
    meta = {"general.architecture": "qwen2", "qwen2.block_count": 2,
            "qwen2.embedding_length": 64, "qwen2.feed_forward_length": 96,
            "qwen2.attention.head_count": 4, "qwen2.attention.head_count_kv": 2,
            "qwen2.rope.freq_base": 1e6, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen2.context_length": 512, "tokenizer.ggml.tokens": ["a"] * 100}
    cfg = ModelConfig.from_gguf_metadata(meta, tied=False)
    assert (cfg.vocab_size, cfg.head_dim, cfg.qkv_bias, cfg.rope_theta) == (100, 16, True, 1e6)
    del meta["qwen2.block_count"]
    with pytest.raises(ModelLoadError, match="qwen2.block_count"):
        ModelConfig.from_gguf_metadata(meta, tied=False)


def test_sliding_window_caps_the_model_length() -> None:
    cfg = dict(hf("mistral_gqa"), sliding_window=64)
    assert ModelConfig.from_hf_config(cfg).max_model_len == 64
    assert ModelConfig.from_hf_config(hf("mistral_gqa")).max_model_len == 256
    qwen = dict(hf("qwen2_bias_tied"), sliding_window=32, use_sliding_window=False)
    assert ModelConfig.from_hf_config(qwen).max_model_len == 256


def test_presets() -> None:
    assert ModelConfig.smollm2_135m().num_params == 134_515_008
    assert ModelConfig.tiny("qwen3").qk_norm
    with pytest.raises(ModelLoadError, match="'gpt2'"):
        ModelConfig.tiny("gpt2")
