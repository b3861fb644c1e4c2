"""Gradients through `jaxengine.score` w.r.t. the weights, on each attention backend: against a
dense jnp model's gradients over the same params pytree (tests/fixtures/dense_model.py) and
central finite differences, under `jax.jit(jax.value_and_grad(...))` with the params traced;
bfloat16 and int8 weights give finite gradients."""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine import encode_batch, generate, load_model_fns, score
from jaxengine.engine import build
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.fake import LOGIT, fake_model
from jaxengine.model.fns import ModelFns
from jaxengine.model.step import make_model_step, split_model
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


@cache
def _value_and_grad(name: str, backend: str, dtype: str = "float32",
                    quantization: str | None = None) -> tuple[ModelFns, Any]:
    """A model and `jit(value_and_grad)` of its loss, compiled once per module for every test
    (and every set of weights of its shapes) that asks for it."""
    fns = _fns(name, backend, dtype, quantization)
    return fns, jax.jit(jax.value_and_grad(_score_loss(fns),
                                           allow_int=quantization is not None))


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


# One fixture per backend in the default run (10-25 s each here), the rest slow: GQA with q/k/v
# biases and a tied head, untied GQA, tied MHA.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(("backend", "name"), [
    ("reference", "qwen2_bias_tied"), ("cpu", "mistral_gqa"),
    pytest.param("reference", "mistral_gqa", marks=SLOW),
    pytest.param("reference", "llama_tied_mha", marks=SLOW),
    pytest.param("cpu", "qwen2_bias_tied", marks=SLOW),
    pytest.param("cpu", "llama_tied_mha", marks=SLOW)])
def test_gradients_match_the_dense_model_and_finite_differences(backend: str,
                                                                name: str) -> None:
    """f32: the loss agrees with the dense model's to 1e-5; its gradient, from
    `jit(value_and_grad)` with the params traced, agrees with the dense model's to 1e-4 in
    relative norm over the whole pytree and per leaf, and with a central finite difference
    along a random direction to 3e-3 (f32 rounding of the loss, divided by the step, allows
    no less: the dense model's own gradient meets it by 5e-6 to 7e-4)."""
    fns, value_and_grad = _value_and_grad(name, backend)
    value, grads = value_and_grad(fns.params)
    dense_value, dense_grads = jax.value_and_grad(_dense_loss(name))(fns.params)
    np.testing.assert_allclose(value, dense_value, rtol=1e-5)
    assert _relative_error(grads, dense_grads) <= 1e-4
    for (path, want), g in zip(jax.tree_util.tree_flatten_with_path(dense_grads)[0],
                               jax.tree.leaves(grads), strict=True):
        assert _relative_error(g, want) <= 1e-4, jax.tree_util.keystr(path)
    leaves, treedef = jax.tree.flatten(fns.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    direction = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype)
                                             for k, x in zip(keys, leaves, strict=True)])
    eps = 3e-3 / _norm(direction) * _norm(fns.params)
    loss = lambda s: value_and_grad(jax.tree.map(  # noqa: E731  (the same program)
        lambda p, d: p + s * d, fns.params, direction))[0]
    finite = (loss(eps) - loss(-eps)) / (2 * eps)
    along = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(
        direction), strict=True))
    np.testing.assert_allclose(finite, along, rtol=3e-3)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("reference", marks=SLOW)])
def test_bfloat16_gradients_are_finite_and_near_float32s(backend: str) -> None:
    """bfloat16 weights (not packed: another pytree) give finite gradients, within 3% in
    relative norm of float32's on the leaves both share (the embedding table, every norm)."""
    name = "mistral_gqa"  # untied: its embedding table is the same leaf in both dtypes
    (f32, f32_grad), (bf16, bf16_grad) = (_value_and_grad(name, backend, dtype)
                                          for dtype in ("float32", "bfloat16"))
    want, got = f32_grad(f32.params)[1], bf16_grad(bf16.params)[1]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    f32_leaves = {jax.tree_util.keystr(p): g for p, g in
                  jax.tree_util.tree_flatten_with_path(want)[0]}
    shared = [(f32_leaves[k], g) for p, g in jax.tree_util.tree_flatten_with_path(got)[0]
              if (k := jax.tree_util.keystr(p)) in f32_leaves and f32_leaves[k].shape == g.shape]
    assert len(shared) == 1 + 2 * 2 + 1  # the embedding, two norms per layer, the final norm
    for w, g in shared:
        assert _relative_error(g, w) <= 3e-2


def test_int8_weights_give_finite_gradients_for_their_float_leaves() -> None:
    """int8 weights: `jax.grad(..., allow_int=True)` differentiates w.r.t. the float leaves
    (norms, column scales) through the packed int8 kernels; the int8 values get float0."""
    fns, value_and_grad = _value_and_grad("mistral_gqa", "cpu", quantization="int8")
    grads = value_and_grad(fns.params)[1]
    kinds = {(jnp.dtype(x.dtype), jnp.dtype(g.dtype)) for x, g in zip(
        jax.tree.leaves(fns.params), jax.tree.leaves(grads), strict=True)}
    assert kinds == {(jnp.dtype(jnp.float32),) * 2,
                     (jnp.dtype(jnp.int8), jnp.dtype(jax.dtypes.float0))}
    floats = [g for g in jax.tree.leaves(grads) if g.dtype == jnp.float32]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in floats) and _norm(floats) > 0


def _pallas_and_reference(impl: str, *, abstract: bool = False) -> tuple[ModelFns, ModelFns]:
    """A one-layer model over a Pallas kernel (interpret mode, on CPU) and over the jnp
    reference attention: the same weights, shapes both kernels accept. `abstract`: weights
    as shapes only (nnx.eval_shape), all that lowering needs."""
    cfg = ModelConfig.tiny(num_layers=1, hidden_size=64, head_dim=64)
    model = nnx.eval_shape(lambda: Model(cfg, seed=3)) if abstract else Model(cfg, seed=3)
    reference = build.model_fns(model, cfg, attn_impl="reference", pack=False)
    graphdef, _ = split_model(model)
    return dataclasses.replace(reference, step=make_model_step(
        graphdef, attn_impl=impl, interpret=True)), reference


def _jit_value_and_grad(fns: ModelFns, block_size: int = 8) -> Any:
    ids, lens, cont, clens = _batch()
    return jax.jit(jax.value_and_grad(lambda p: -score(
        fns, ids, cont, lens, clens, params=p, block_size=block_size).total.sum()))


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_pallas_kernels_lower_under_grad(impl: str) -> None:
    """`jax.jit(jax.value_and_grad(score))` over a Pallas kernel traces and lowers (compiling
    and running it in interpret mode is the slow test below)."""
    pallas, _ = _pallas_and_reference(impl, abstract=True)
    _, grads = _jit_value_and_grad(pallas).lower(pallas.params).out_info  # raises if it cannot
    assert jax.tree.structure(grads) == jax.tree.structure(pallas.params)


@pytest.mark.slow  # interpret mode compiles for ~20 s here
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_pallas_kernels_give_the_references_gradients_in_interpret_mode(impl: str) -> None:
    """Over a Pallas kernel `score` has the loss and the gradients it has over the jnp
    reference, to 1e-5 and 1e-4 relative. The kernels' own backward passes are tested alone
    in tests/jaxengine_kernels."""
    pallas, reference = _pallas_and_reference(impl)
    (value, grads), (want_value, want) = (_jit_value_and_grad(f)(f.params)
                                          for f in (pallas, reference))
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    assert _relative_error(grads, want) <= 1e-4


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
