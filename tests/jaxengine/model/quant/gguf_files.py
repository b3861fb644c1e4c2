"""Tiny GGUF files of random weights whose projections and embedding are blocks of one type.

`write_blocks_gguf(path, cfg, qtype)` writes a Llama model of `cfg` as llama.cpp lays it out
(tied embedding, Q/K rows in its rotary order: the blocks are random, so their order is
whatever the file says), norms F32, every matrix in `qtype`; with the fixtures' tokenizer
metadata so it loads with one. `k_m_types(cfg)` gives the per-layer types of llama.cpp's
Q4_K_M recipe for `types=`.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from jaxengine.model.config import ModelConfig
from tests.fixtures.model_helpers import FIXTURES, load_json
from tests.jaxengine.loading.test_load import add_model_keys
from tests.jaxengine_kernels.test_gguf_blocks import random_rows

Q = gguf.GGMLQuantizationType


def blocks_config(**overrides: int) -> ModelConfig:
    """A tiny Llama whose matrices are whole 256-value k-quant blocks along their input."""
    fields = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                  head_dim=64, vocab_size=128, tie_word_embeddings=True)
    return ModelConfig.tiny("llama", **(fields | overrides))


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in its "_M"
    mixes (src/llama-quant.cpp `use_more_bits`): the first and last eighth, and every third
    between."""
    return (layer < num_layers // 8 or layer >= 7 * num_layers // 8
            or (layer - num_layers // 8) % 3 == 2)


def k_m_types(cfg: ModelConfig, *, v: tuple[Q, Q] = (Q.Q4_K, Q.Q6_K),
              down: tuple[Q, Q] = (Q.Q4_K, Q.Q6_K)) -> dict[str, Q]:
    """Per-layer types of llama.cpp's Q4_K_M recipe, by GGUF name: attn_v and ffn_down in
    `v[1]` / `down[1]` where `use_more_bits`, else `v[0]` / `down[0]` (llama.cpp falls back to
    Q5_0 / Q8_0 for rows that are not whole 256-value blocks, as Qwen's 896-wide ones)."""
    more = [use_more_bits(i, cfg.num_layers) for i in range(cfg.num_layers)]
    return {f"blk.{i}.{name}.weight": pair[m] for i, m in enumerate(more)
            for name, pair in (("attn_v", v), ("ffn_down", down))}


def _matrices(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """GGUF name -> [out, in] of every matrix of a Llama of `cfg` (tied)."""
    D, F, NH, KH = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                    cfg.num_kv_heads * cfg.head_dim)
    shapes = {"token_embd.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_layers):
        shapes |= {f"blk.{i}.attn_q.weight": (NH, D), f"blk.{i}.attn_k.weight": (KH, D),
                   f"blk.{i}.attn_v.weight": (KH, D), f"blk.{i}.attn_output.weight": (D, NH),
                   f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                   f"blk.{i}.ffn_down.weight": (D, F)}
    return shapes


def write_blocks_gguf(path: Path, cfg: ModelConfig, qtype: Q, *, seed: int = 0,
                      types: dict[str, Q] | None = None) -> None:
    """Write a Llama of `cfg` with random `qtype` matrices (`types`: other types, F32
    included, by GGUF name) and unit F32 norms to `path`."""
    w = gguf.GGUFWriter(str(path), "llama")
    add_model_keys(w, cfg)
    vocab = load_json(FIXTURES / "tiny" / "mistral_gqa" / "tokenizer.json")["model"]["vocab"]
    w.add_token_list(sorted(vocab, key=vocab.get)[:cfg.vocab_size])
    w.add_token_merges([])
    w.add_eos_token_id(2)
    # scales small enough that 2 layers of random weights keep logits of a few units
    scale = {Q.Q4_K: 2e-4, Q.Q5_K: 1e-4, Q.Q6_K: 5e-5}
    for i, (name, (out, inp)) in enumerate(_matrices(cfg).items()):
        t = (types or {}).get(name, qtype)
        if t == Q.F32:
            rng = np.random.default_rng(seed + i)
            w.add_tensor(name, rng.normal(0, 0.05, (out, inp)).astype(np.float32))
        else:
            w.add_tensor(name, random_rows(t, out, inp, seed=seed + i,
                                           scale=scale.get(t, 0.005)), raw_dtype=t)
    for name in ["output_norm.weight", *(f"blk.{i}.{n}_norm.weight" for i in
                                          range(cfg.num_layers) for n in ("attn", "ffn"))]:
        w.add_tensor(name, np.ones(cfg.hidden_size, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
