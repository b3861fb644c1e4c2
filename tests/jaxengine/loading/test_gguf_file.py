"""GGUF metadata -> ModelConfig, and the gguf package's tensor-name map under our HF names."""

from __future__ import annotations

import inspect
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxengine.loading.gguf_file import (
    _Reader,
    gguf_tensor_name,
    model_config_from_gguf,
    open_gguf,
    tensor_name_map,
)
from jaxengine.model.config import ModelConfig, ModelLoadError

# llama.cpp's names, written out here independently of gguf's map, which the loader uses
LLAMA_CPP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
    "model.layers.1.input_layernorm.weight": "blk.1.attn_norm.weight",
    "model.layers.1.post_attention_layernorm.weight": "blk.1.ffn_norm.weight",
    "model.layers.1.self_attn.q_proj.weight": "blk.1.attn_q.weight",
    "model.layers.1.self_attn.k_proj.weight": "blk.1.attn_k.weight",
    "model.layers.1.self_attn.v_proj.weight": "blk.1.attn_v.weight",
    "model.layers.1.self_attn.o_proj.weight": "blk.1.attn_output.weight",
    "model.layers.1.self_attn.q_proj.bias": "blk.1.attn_q.bias",
    "model.layers.1.self_attn.k_proj.bias": "blk.1.attn_k.bias",
    "model.layers.1.self_attn.v_proj.bias": "blk.1.attn_v.bias",
    "model.layers.1.mlp.gate_proj.weight": "blk.1.ffn_gate.weight",
    "model.layers.1.mlp.up_proj.weight": "blk.1.ffn_up.weight",
    "model.layers.1.mlp.down_proj.weight": "blk.1.ffn_down.weight",
}
QK_NORM_NAMES = {"model.layers.1.self_attn.q_norm.weight": "blk.1.attn_q_norm.weight",
                 "model.layers.1.self_attn.k_norm.weight": "blk.1.attn_k_norm.weight"}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tensor_names_are_llama_cpps(arch: str) -> None:
    names = tensor_name_map(ModelConfig.tiny(arch))
    expected = {**LLAMA_CPP_NAMES, **(QK_NORM_NAMES if arch == "qwen3" else {})}
    assert {n: gguf_tensor_name(names, n) for n in expected} == expected
    assert gguf_tensor_name(names, "model.layers.2.self_attn.q_proj.weight") is None  # 2 layers
    assert gguf_tensor_name(names, "model.layers.1.mlp.foo.weight") is None


# a routed layer's router and stacked experts (HF names without the expert index), and the
# dense MLP of a mixed stack's dense layer
QWEN_MOE_NAMES = {
    "model.layers.1.mlp.gate.weight": "blk.1.ffn_gate_inp.weight",
    "model.layers.1.mlp.experts.gate_proj.weight": "blk.1.ffn_gate_exps.weight",
    "model.layers.1.mlp.experts.up_proj.weight": "blk.1.ffn_up_exps.weight",
    "model.layers.1.mlp.experts.down_proj.weight": "blk.1.ffn_down_exps.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
SHARED_EXPERT_NAMES = {
    "model.layers.1.mlp.shared_expert.gate_proj.weight": "blk.1.ffn_gate_shexp.weight",
    "model.layers.1.mlp.shared_expert.up_proj.weight": "blk.1.ffn_up_shexp.weight",
    "model.layers.1.mlp.shared_expert.down_proj.weight": "blk.1.ffn_down_shexp.weight",
    "model.layers.1.mlp.shared_expert_gate.weight": "blk.1.ffn_gate_inp_shexp.weight",
}
MIXTRAL_NAMES = {
    "model.layers.1.block_sparse_moe.gate.weight": "blk.1.ffn_gate_inp.weight",
    "model.layers.1.block_sparse_moe.experts.w1.weight": "blk.1.ffn_gate_exps.weight",
    "model.layers.1.block_sparse_moe.experts.w3.weight": "blk.1.ffn_up_exps.weight",
    "model.layers.1.block_sparse_moe.experts.w2.weight": "blk.1.ffn_down_exps.weight",
}


@pytest.mark.parametrize("arch, expected", [
    ("mixtral", MIXTRAL_NAMES), ("qwen2_moe", QWEN_MOE_NAMES | SHARED_EXPERT_NAMES),
    ("qwen3_moe", QWEN_MOE_NAMES)])
def test_expert_tensor_names_are_llama_cpps(arch: str, expected: dict[str, str]) -> None:
    names = tensor_name_map(ModelConfig.tiny(arch, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=16))
    assert {n: gguf_tensor_name(names, n) for n in expected} == expected
    if arch == "qwen3_moe":  # Qwen3-MoE has no shared expert
        assert {gguf_tensor_name(names, n) for n in SHARED_EXPERT_NAMES} == {None}


def test_gguf_metadata() -> None:
    meta = {"general.architecture": "qwen2", "qwen2.block_count": 2,
            "qwen2.embedding_length": 64, "qwen2.feed_forward_length": 96,
            "qwen2.attention.head_count": 4, "qwen2.attention.head_count_kv": 2,
            "qwen2.rope.freq_base": 1e6, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen2.context_length": 512, "tokenizer.ggml.tokens": ["a"] * 100}
    cfg = model_config_from_gguf(meta, tied=False)
    assert (cfg.vocab_size, cfg.head_dim, cfg.qkv_bias, cfg.rope_theta) == (100, 16, True, 1e6)
    del meta["qwen2.block_count"]
    with pytest.raises(ModelLoadError, match="qwen2.block_count"):
        model_config_from_gguf(meta, tied=False)


@pytest.mark.parametrize("layers, scalar", [(4, 256), (46, 4608 / 32)])
def test_gemma2_metadata_alternates_windows_and_scales_like_llama_cpp(layers: int,
                                                                      scalar: float) -> None:
    """llama.cpp's Gemma 2: local layers first, every other one; the softmax scale is
    key_length ** -0.5, except the 27B (46 layers), which scales by hidden / heads."""
    meta = {"general.architecture": "gemma2", "gemma2.block_count": layers,
            "gemma2.embedding_length": 4608, "gemma2.feed_forward_length": 36864,
            "gemma2.attention.head_count": 32, "gemma2.attention.head_count_kv": 16,
            "gemma2.attention.key_length": 256, "gemma2.attention.sliding_window": 4096,
            "gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
            "gemma2.context_length": 8192, "tokenizer.ggml.tokens": ["a"] * 100}
    cfg = model_config_from_gguf(meta, tied=True)
    assert cfg.architecture == "gemma2" and cfg.layer_windows[:3] == (4096, 0, 4096)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    assert cfg.attn_scale == pytest.approx(scalar**-0.5) and cfg.rope_local_theta is None


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        model_config_from_gguf({"general.architecture": "falcon"}, tied=True)


def test_the_reader_overrides_the_private_get_gguf_still_has() -> None:
    """`_Reader._get` replaces gguf's private `GGUFReader._get` (pyproject.toml pins gguf to
    the versions that have it as below); a gguf release that changes it must fail here."""
    def shape(f):  # type: ignore[no-untyped-def]
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert shape(gguf.GGUFReader._get) == shape(_Reader._get), (
        f"gguf {version('gguf')} changed GGUFReader._get's signature to "
        f"{inspect.signature(gguf.GGUFReader._get)}; jaxengine/loading/gguf_file.py's _Reader "
        "overrides it as (self, offset, dtype, count=1, override_order=None): update the "
        "override (or drop it) and the gguf pin in pyproject.toml")


def test_the_reader_reads_what_gguf_reads(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 1e4)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.linspace(-1, 1, 8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = open_gguf(str(path)), gguf.GGUFReader(str(path))
    assert isinstance(ours, _Reader)
    assert {k: f.contents() for k, f in ours.fields.items()} == {
        k: f.contents() for k, f in theirs.fields.items()}
    assert [(t.name, t.tensor_type, t.data.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data.tolist()) for t in theirs.tensors]
