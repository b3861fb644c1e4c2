"""Reading an HF config.json through transformers' AutoConfig: each supported architecture,
old and new RoPE fields, and clear errors for what we do not support or cannot read."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxengine.loading.hf import read_hf_config
from jaxengine.model.config import ModelConfig, ModelLoadError, RopeScaling
from jaxengine.model.layers import rope_inv_freq
from tests.fixtures.model_helpers import FIXTURES, load_json

TINY = FIXTURES / "tiny"


def read(tmp_path: Path, name: str, *, drop: Sequence[str] = (), **changes: Any) -> ModelConfig:
    """`read_hf_config` of fixture `name`'s config.json with `changes` set and `drop` removed."""
    cfg = {**load_json(TINY / name / "config.json"), **changes}
    for key in drop:
        del cfg[key]
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return read_hf_config(str(path))


def test_reads_each_architecture_from_hf_config() -> None:
    llama3 = read_hf_config(TINY / "llama3_gqa")
    assert (llama3.architecture, llama3.num_heads, llama3.num_kv_heads) == ("llama", 4, 2)
    assert llama3.rope_scaling == RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0,
                                              original_max_position_embeddings=64)
    assert not llama3.tie_word_embeddings
    tied = read_hf_config(TINY / "llama_tied_mha")
    assert tied.tie_word_embeddings and tied.num_kv_heads == 4 and tied.num_layers == 3
    mistral = read_hf_config(TINY / "mistral_gqa")
    assert mistral.architecture == "mistral" and mistral.rope_theta == 1e6
    qwen2 = read_hf_config(TINY / "qwen2_bias_tied")
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.sliding_window is None
    assert qwen2.head_dim == 8  # no head_dim in the file: hidden_size // num_attention_heads
    qwen3 = read_hf_config(TINY / "qwen3_qknorm")
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16


def test_old_style_rope_fields(tmp_path: Path) -> None:
    parsed = read(tmp_path, "llama3_gqa", drop=["rope_parameters"], rope_theta=5e5,
                  rope_scaling=dict(type="linear", factor=2.0))
    assert parsed.rope_theta == 5e5 and parsed.rope_scaling.kind == "linear"
    inv = rope_inv_freq(8, 5e5, parsed.rope_scaling)
    np.testing.assert_allclose(inv, rope_inv_freq(8, 5e5, None) / 2, rtol=1e-6)
    llama3 = read(tmp_path, "llama3_gqa", drop=["rope_parameters"], rope_theta=5e5,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64))
    assert llama3.rope_scaling == read_hf_config(TINY / "llama3_gqa").rope_scaling


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        read(tmp_path, "llama3_gqa", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    # one transformers does not know either: still our message, not transformers'
    with pytest.raises(ModelLoadError, match="'FooForCausalLM' \\(model_type='foo'\\)"):
        read(tmp_path, "llama3_gqa", model_type="foo", architectures=["FooForCausalLM"])


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "'yarn' is not supported"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_key_value_heads=3), "num_heads=4 must be a multiple of num_kv_heads=3"),
    (dict(hidden_size=0), "hidden_size must be > 0, got 0"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0, rope_theta=1e4)),
     "config.json: transformers cannot read it .*low_freq_factor"),
])
def test_invalid_configs_say_what_is_wrong(tmp_path: Path, change: dict, message: str) -> None:
    drop = ["head_dim"] if "hidden_size" in change else []
    with pytest.raises(ModelLoadError, match=message):
        read(tmp_path, "llama3_gqa", drop=drop, **change)


def test_missing_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="'intermediate_size'"):
        read(tmp_path, "mistral_gqa", drop=["intermediate_size"])
    with pytest.raises(ModelLoadError, match="'hidden_size'"):
        read(tmp_path, "mistral_gqa", hidden_size=None)


def test_a_sliding_window_is_per_layer_not_a_length_cap(tmp_path: Path) -> None:
    mistral = read(tmp_path, "mistral_gqa", sliding_window=64)
    assert mistral.max_model_len == 256 and mistral.layer_windows == (64, 64)
    assert read_hf_config(TINY / "mistral_gqa").layer_windows == (0, 0)
    qwen = read(tmp_path, "qwen2_bias_tied", sliding_window=32, use_sliding_window=False)
    assert qwen.max_model_len == 256 and qwen.layer_windows == (0, 0)
    # Qwen2: only the layers from max_window_layers on slide
    assert read_hf_config(TINY / "qwen2_window").layer_windows == (0, 8, 8)


def test_reads_gemma_fields() -> None:
    gemma2 = read_hf_config(TINY / "gemma2_softcap")
    assert (gemma2.architecture, gemma2.hidden_act) == ("gemma2", "gelu_pytorch_tanh")
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (1.0, 2.0)
    assert gemma2.attn_scale == 24**-0.5 and not gemma2.qk_norm
    assert gemma2.layer_windows == (8, 0, 8, 0) and gemma2.rope_local_theta is None
    gemma3 = read_hf_config(TINY / "gemma3_text")
    assert gemma3.qk_norm and gemma3.layer_windows == (8, 8, 0, 8, 8, 0)
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1e6, 1e4)
    assert gemma3.rope_scaling == RopeScaling(kind="linear", factor=8.0)
    # the text decoder of a multimodal checkpoint: the same fields
    assert read_hf_config(TINY / "gemma3_vl") == gemma3


@pytest.mark.parametrize("name, change, message", [
    ("llama3_gqa", dict(attn_logit_softcapping=30.0),
     "attn_logit_softcapping=30.0 is not supported: the llama family does not"),
    ("mistral_gqa", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ("gemma2_softcap", dict(hidden_activation="relu"), "hidden_activation='relu'"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3_text", dict(rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1e6),
        sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("gemma3_text", dict(layer_types=["sliding_attention"] * 5 + ["chunked_attention"]),
     "'chunked_attention'"),
])
def test_a_field_we_do_not_implement_is_named(tmp_path: Path, name: str, change: dict,
                                              message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        read(tmp_path, name, **change)
