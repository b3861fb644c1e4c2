"""The committed tiny checkpoints (made by tests/make_fixtures.py) are what their tests assume:
each oracle agrees with its config and with itself, and the configs of the Gemma, sliding-window
and mixture-of-experts families read back through transformers with the structure they exist for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoConfig

from tests.fixtures.model_helpers import ALL_TINY_DIRS, FIXTURES, UNSERVED_TINY, load_json

TINY = FIXTURES / "tiny"
GREEDY_STEPS = 12
MIN_GAP = 1e-3  # make_fixtures.py reseeds until greedy margins and router gaps exceed it
WINDOW = 8
SLIDE, FULL = "sliding_attention", "full_attention"
# name: (model_type, sliding_window, layer_types) as transformers reads them back; Mistral slides
# every layer without layer_types, and Qwen2-MoE writes a window of 0 for none.
FAMILIES = {
    "gemma2_softcap": ("gemma2", WINDOW, [SLIDE, FULL] * 2),
    "gemma3_text": ("gemma3_text", WINDOW, [SLIDE, SLIDE, FULL] * 2),
    "gemma3_vl": ("gemma3", WINDOW, [SLIDE, SLIDE, FULL] * 2),
    "mistral_window": ("mistral", WINDOW, None),
    "qwen2_window": ("qwen2", WINDOW, [FULL, SLIDE, SLIDE]),
    "mixtral_moe": ("mixtral", None, None),
    "qwen2_moe": ("qwen2_moe", 0, [FULL] * 3),
    "qwen3_moe": ("qwen3_moe", None, None),
}


def text_config(path: Path) -> dict:
    """The language model's fields of a fixture's config.json (nested in a VL checkpoint)."""
    cfg = load_json(path / "config.json")
    return cfg.get("text_config", cfg)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """f64 log-softmax over the last axis."""
    x = x.astype(np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.parametrize("path", ALL_TINY_DIRS, ids=lambda p: p.name)
def test_oracle_matches_its_config(path: Path) -> None:
    oracle = np.load(path / "oracle.npz")
    vocab = text_config(path)["vocab_size"]
    ids, logits = oracle["input_ids"], oracle["logits"]
    assert ids.dtype == np.int32 and ids.ndim == 1 and ids.min() >= 0 and ids.max() < vocab
    assert logits.dtype == np.float32 and logits.shape == (len(ids), vocab)
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_oracle_is_consistent_and_far_from_ties(name: str) -> None:
    path = TINY / name
    oracle = np.load(path / "oracle.npz")
    vocab = text_config(path)["vocab_size"]
    greedy, logprobs = oracle["greedy_ids"], oracle["greedy_logprobs"]
    assert greedy.shape == logprobs.shape == oracle["greedy_margins"].shape == (GREEDY_STEPS,)
    assert greedy.dtype == np.int32 and greedy.min() >= 0 and greedy.max() < vocab
    assert logprobs.dtype == np.float32 and (logprobs <= 0).all() and np.isfinite(logprobs).all()
    # The first greedy step is the prompt's last row of logits, kept in the same oracle.
    last = oracle["logits"][-1]
    assert greedy[0] == last.argmax()
    assert abs(log_softmax(last)[greedy[0]] - logprobs[0]) < 1e-5
    assert oracle["greedy_margins"].min() > MIN_GAP
    assert oracle["router_min_gap"] > MIN_GAP  # inf for a model without routers
    assert len(oracle["input_ids"]) > WINDOW  # the windowed layers really drop keys


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_reads_with_the_structure_it_is_for(name: str) -> None:
    model_type, window, layer_types = FAMILIES[name]
    cfg = AutoConfig.from_pretrained(TINY / name)
    assert cfg.model_type == model_type
    text = cfg.get_text_config()
    assert (text.sliding_window, getattr(text, "layer_types", None)) == (window, layer_types)


def test_moe_configs_route_as_described() -> None:
    read = {n: AutoConfig.from_pretrained(TINY / n)
            for n in ("mixtral_moe", "qwen2_moe", "qwen3_moe")}
    mixtral, qwen2, qwen3 = read["mixtral_moe"], read["qwen2_moe"], read["qwen3_moe"]
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.norm_topk_prob) == (8, 4, False)
    assert qwen2.mlp_only_layers == [1] and qwen2.shared_expert_intermediate_size == 48
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.norm_topk_prob) == (8, 2, True)
    assert qwen3.decoder_sparse_step == 2 and qwen3.mlp_only_layers == []


def test_gemma_configs_carry_their_caps_and_rope() -> None:
    gemma2 = AutoConfig.from_pretrained(TINY / "gemma2_softcap")
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (1.0, 2.0)
    assert gemma2.query_pre_attn_scalar == 24 and gemma2.tie_word_embeddings
    for name in ("gemma3_text", "gemma3_vl"):
        text = AutoConfig.from_pretrained(TINY / name).get_text_config()
        assert text.rope_parameters == {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def test_every_unserved_fixture_is_checked_here() -> None:
    on_disk = {p.name for p in ALL_TINY_DIRS}
    assert set(FAMILIES) <= on_disk
    assert set(FAMILIES) >= UNSERVED_TINY
