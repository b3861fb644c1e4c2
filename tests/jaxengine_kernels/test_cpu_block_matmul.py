"""The native matmul over GGUF Q4_1 / Q8_0 blocks against the float64 product over
`gguf.quants.dequantize`'s weights (blocks made by `gguf.quants.quantize`): row counts around
the register blocks (decode rows dequantized in registers, more through the scratch) and the
96-row runs, odd N, live rows, the fused SwiGLU, a row's bits whatever rows are beside it, each
x86 ISA build (the f16 scales by their bits without F16C, subnormal ones included), and clear
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from jaxengine_kernels.cpu import native
from jaxengine_kernels.cpu.block_matmul import (
    BLOCK_BYTES,
    block_matmul,
    block_swiglu,
    q4_1_matmul,
    q8_0_matmul,
)

TYPES = ("Q4_1", "Q8_0")


def blocks_of(w: np.ndarray, quant_type: str) -> tuple[np.ndarray, np.ndarray]:
    """w f32[N, K] -> (its blocks u8[N, K/32 * B], the weights they dequantize to f32[N, K])."""
    kind = GGMLQuantizationType[quant_type]
    blocks = quants.quantize(w, kind)
    return blocks, quants.dequantize(blocks, kind)


def operands(m: int, k: int, n: int, quant_type: str, seed: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32) + rng.standard_normal((n, 1)) * 0.5
    return (x, *blocks_of(w.astype(np.float32), quant_type))


def check(y: jax.Array | np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """x @ w.T to 1e-5 of |x| @ |w|.T, the scale of float32's rounding of the K products."""
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert np.all(np.abs(np.asarray(y) - want) <= 1e-5 * bound)


# 1-6 rows in registers (AVX-512; 1-2 otherwise), 7 and more through the scratch, runs of 96.
@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (1, 576, 192), (3, 64, 70), (6, 96, 17),
                                   (7, 1536, 13), (100, 96, 33), (200, 64, 5)])
def test_matches_the_product_over_the_dequantized_file(quant_type, m, k, n):
    x, blocks, w = operands(m, k, n, quant_type, seed=m * k + n)
    y = jax.jit(block_matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(blocks), quant_type)
    check(y, x, w)


def test_the_named_products_are_the_types():
    x, blocks, w = operands(2, 64, 9, "Q4_1", seed=1)
    check(q4_1_matmul(jnp.asarray(x), jnp.asarray(blocks)), x, w)
    x, blocks, w = operands(2, 64, 9, "Q8_0", seed=1)
    check(q8_0_matmul(jnp.asarray(x).reshape(1, 2, 64), jnp.asarray(blocks))[0], x, w)


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("m,live", [(8, 1), (64, 49), (64, 0), (200, 97)])
def test_live_rows_are_computed_and_the_padding_is_zero(quant_type, m, live):
    x, blocks, w = operands(m, 64, 40, quant_type, seed=m + live)
    x[live:] = np.nan
    y = np.asarray(jax.jit(block_matmul, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(blocks), quant_type, jnp.int32(live)))
    check(y[:live], x[:live], w)
    assert not y[live:].any()


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (4, 64, 70), (13, 96, 33)])
def test_the_swiglu_product_is_silu_of_the_gate_times_up(quant_type, m, k, n):
    x, gate_blocks, gate = operands(m, k, n, quant_type, seed=m)
    _, up_blocks, up = operands(m, k, n, quant_type, seed=m + 1)
    y = np.asarray(block_swiglu(jnp.asarray(x), jnp.asarray(gate_blocks),
                                jnp.asarray(up_blocks), quant_type))
    g = x.astype(np.float64) @ gate.astype(np.float64).T
    want = g * np.exp(-np.logaddexp(0, -g)) * (x.astype(np.float64) @ up.astype(np.float64).T)
    scale = np.sqrt(k) * np.maximum(1, np.abs(want))
    assert np.all(np.abs(y - want) <= 2e-5 * scale)


@pytest.mark.parametrize("quant_type", TYPES)
def test_a_row_does_not_depend_on_the_row_count(quant_type):
    """Registers (a decode's rows) or the scratch (more rows): the same sums in the same order."""
    x, blocks, _ = operands(200, 576, 70, quant_type, seed=5)
    product = jax.jit(lambda x, live: block_matmul(x, jnp.asarray(blocks), quant_type, live))
    alone = np.asarray(jax.vmap(lambda row: product(row[None], 1)[0])(jnp.asarray(x)))
    for m in (1, 2, 3, 6, 7, 9, 96, 97, 200):
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x), m))[:m], alone[:m])


def test_bad_operands_are_refused_naming_what_is_read():
    x, blocks, _ = operands(2, 64, 9, "Q4_1", seed=2)
    with pytest.raises(ValueError, match=r"reads GGUF Q4_1, Q8_0 blocks, not 'Q4_0'"):
        block_matmul(jnp.asarray(x), jnp.asarray(blocks), "Q4_0")
    with pytest.raises(ValueError, match=r"Q8_0 blocks \(9, 40\) do not hold \[N, 64\]"):
        block_matmul(jnp.asarray(x), jnp.asarray(blocks), "Q8_0")
    with pytest.raises(ValueError, match=r"Q4_1 blocks \(9, 40\) do not hold \[N, 48\]"):
        block_matmul(jnp.ones((2, 48)), jnp.asarray(blocks), "Q4_1")
    with pytest.raises(ValueError, match="takes float32 x and uint8 blocks, got bfloat16"):
        block_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(blocks), "Q4_1")


def special_scales(quant_type: str) -> np.ndarray:
    """Blocks u8[4, 2 * B] whose f16 scales are subnormal, negative, zero and large: the
    conversion without F16C (by the bits) must give each exactly."""
    rng = np.random.default_rng(7)
    size = BLOCK_BYTES[quant_type]
    blocks = rng.integers(0, 256, (4, 2, size), dtype=np.uint8)
    halves = np.array([2.0**-20, -0.375, 0.0, 3.0e4], np.float16)
    heads = 2 if quant_type == "Q4_1" else 1  # Q4_1: d and m; Q8_0: d
    for i, h in enumerate(halves):
        for j in range(heads):
            blocks[i, :, 2 * j:2 * j + 2] = np.frombuffer(h.tobytes(), np.uint8)
    return blocks.reshape(4, 2 * size)


@pytest.mark.parametrize("isa", native.X86_ISAS)
def test_every_isa_build_matches_the_dequantized_file(isa, isa_library):
    """AVX-512 (16-float vectors, 6 x 4 register blocks), AVX2 (8, 2 x 4) and baseline SSE2 (4,
    f16 by its bits): each build against numpy where the CPU runs it."""
    library = isa_library(isa)
    for quant_type in TYPES:
        symbol = f"BlockMatmul{quant_type}"
        target = f"jaxengine_test_block_matmul_{quant_type.lower()}_{isa}"
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
        kind = GGMLQuantizationType[quant_type]
        cases = [operands(m, k, n, quant_type, seed=m) for m, k, n in
                 [(1, 64, 5), (3, 96, 70), (130, 32, 9)]]
        special = special_scales(quant_type)
        x = np.random.default_rng(8).standard_normal((2, 64)).astype(np.float32)
        cases.append((x, special, quants.dequantize(special, kind)))
        for x, blocks, w in cases:
            m, n = x.shape[0], blocks.shape[0]
            y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))(
                jnp.asarray(x), jnp.asarray(blocks), jnp.asarray(blocks), jnp.int32(m))
            check(y, x, w)
