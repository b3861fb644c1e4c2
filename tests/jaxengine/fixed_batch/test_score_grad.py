"""Gradients through `jaxengine.score` w.r.t. the weights, on each attention backend: against a
dense jnp model's gradients over the same params pytree (tests/fixtures/dense_model.py) and
central finite differences, under `jax.jit(jax.value_and_grad(...))` with the params traced;
bfloat16 and int8 weights give finite gradients."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine import encode_batch, generate, load_model_fns, score
from jaxengine.model.fake import LOGIT, fake_model
from jaxengine.model.fns import ModelFns
from tests.fixtures.dense_model import DenseConfig, dense_logprobs

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
# Rows of several lengths: left-padded prompts, right-padded continuations.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [42, 43, 44, 45, 46]]
CONTINUATIONS = np.asarray([[3, 4, 5, 6, 7], [7, 8, 9, 0, 0], [11, 12, 13, 14, 0]], np.int32)
CONTINUATION_LENS = np.asarray([5, 3, 4], np.int32)
BLOCK = 4


def _batch() -> tuple[jax.Array, ...]:
    ids, lens = encode_batch(None, PROMPTS)
    return jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(CONTINUATIONS), jnp.asarray(
        CONTINUATION_LENS)


@cache
def _fns(name: str, backend: str, dtype: str = "float32",
         quantization: str | None = None) -> ModelFns:
    return load_model_fns(str(TINY / name), attention_backend=backend, dtype=dtype,
                          block_size=BLOCK, quantization=quantization)[0]


def _score_loss(fns: ModelFns) -> Any:
    """params -> the batch's negative log-likelihood by `score`."""
    ids, lens, cont, clens = _batch()
    return lambda p: -score(fns, ids, cont, lens, clens, params=p, block_size=BLOCK).total.sum()


def _dense_loss(name: str) -> Any:
    """params -> the same negative log-likelihood by the dense model."""
    cfg, (ids, lens, cont, clens) = DenseConfig.of(TINY / name), _batch()
    return lambda p: -dense_logprobs(cfg, p, ids, cont, lens, clens).sum()


def _norm(tree: Any) -> float:
    return float(jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                              for x in jax.tree.leaves(tree))))


def _relative_error(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| over the whole pytree (every leaf at once)."""
    return _norm(jax.tree.map(lambda a, b: a - b, got, want)) / _norm(want)


def test_generate_refuses_gradients_and_scoring_its_tokens_gives_them() -> None:
    """`jax.grad` through `generate` says what to do instead; doing it gives the gradient by
    hand: the fake model's greedy token has logit LOGIT, so d total / d LOGIT is
    N (V - 1) / (e^LOGIT + V - 1) for N tokens over a vocabulary of V."""
    V, N = 97, 3
    model = fake_model(V)
    ids, lens = encode_batch(None, [[5, 6, 7]])
    with pytest.raises(ValueError, match="then take gradients of jaxengine.score"):
        jax.grad(lambda p: generate(model, ids, lens, max_new_tokens=N, params=p,
                                    block_size=BLOCK).logprobs.sum())(model.params)
    out = generate(model, ids, lens, max_new_tokens=N, block_size=BLOCK)
    grads = jax.grad(lambda p: score(model, ids, out.tokens, lens, out.lengths, params=p,
                                     block_size=BLOCK).total.sum())(model.params)
    # f32 rounding of a softmax tail of 0.004 per token: 1e-4 relative
    np.testing.assert_allclose(grads["logit"], N * (V - 1) / (np.exp(LOGIT) + V - 1),
                               rtol=1e-4)
