"""The jnp dequantizers of GGUF blocks against the gguf package's, bit for bit."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest

from jaxengine_kernels.gguf_blocks import (
    BLOCK_FORMATS,
    block_format,
    dequantize,
    dequantize_slots,
    slot_layout,
    to_slots,
)

Q = gguf.GGMLQuantizationType
# gguf.quants.quantize makes these; k-quants: random
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.TQ2_0)


def random_rows(qtype: Q, rows: int, cols: int, seed: int = 0, scale: float = 0.1
                ) -> np.ndarray:
    """u8[rows, row_bytes] of `qtype`: quantized normal values (deviation `scale` * 10) where
    the gguf package can quantize the type, else random bytes with every f16 scale a finite
    number in [-scale, scale]."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        values = rng.normal(0, 10 * scale, (rows, cols)).astype(np.float32)
        return gguf.quants.quantize(values, qtype)
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // size, nbytes), np.uint8)
    # f16 fields: d (and dmin) at the start of a k-quant block, d at the end of Q6_K's
    at = [208] if qtype == Q.Q6_K else [0, 2]
    for i in at:
        blocks[:, i:i + 2] = rng.uniform(-scale, scale, len(blocks)).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS))
def test_equals_gguf_dequantize(qtype: Q) -> None:
    fmt = BLOCK_FORMATS[qtype]
    rows = random_rows(qtype, 6, 2 * fmt.block_size)
    want = gguf.quants.dequantize(rows, qtype)
    got = np.asarray(jax.jit(dequantize, static_argnames="qtype")(rows, qtype=qtype))
    assert got.dtype == np.float32 and got.shape == want.shape == (6, 2 * fmt.block_size)
    np.testing.assert_array_equal(got, want)
    assert np.abs(want).max() > 0  # the bytes hold values, not only zeros


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS))
def test_leading_axes_and_zero_blocks(qtype: Q) -> None:
    fmt = BLOCK_FORMATS[qtype]
    rows = random_rows(qtype, 2 * 3, fmt.block_size, seed=1).reshape(2, 3, -1)
    got = np.asarray(dequantize(rows, qtype))
    want = gguf.quants.dequantize(rows.reshape(6, -1), qtype).reshape(2, 3, -1)
    np.testing.assert_array_equal(got, want)
    zeros = np.asarray(dequantize(np.zeros((2, fmt.block_bytes), np.uint8), qtype))
    np.testing.assert_array_equal(zeros, np.zeros((2, fmt.block_size), np.float32))


def test_unsupported_types_are_named() -> None:
    with pytest.raises(ValueError, match="Q2_K is not served.*Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                       "Q4_K, Q5_K, Q6_K"):
        block_format(Q.Q2_K)
    with pytest.raises(ValueError, match="unknown GGUF quantization type 'Q9'"):
        block_format("Q9")
    with pytest.raises(ValueError, match="Q4_1 rows of 30 bytes are not whole blocks of 20"):
        dequantize(np.zeros((1, 30), np.uint8), Q.Q4_1)


@pytest.mark.parametrize(("qtypes", "slot"), [((Q.Q4_K, Q.Q6_K), (256, 210)),
                                              ((Q.Q5_0, Q.Q8_0), (32, 34)),
                                              ((Q.Q8_0, Q.Q4_K), (256, 8 * 34))])
def test_slots_of_a_mix_dequantize_by_each_layers_type(qtypes: tuple[Q, Q],
                                                       slot: tuple[int, int]) -> None:
    """Rows of either type padded into the mix's slots (values, bytes) come back as gguf's
    values, bit for bit, by a traced type index."""
    layout = slot_layout(qtypes)
    assert (layout.values, layout.slot_bytes) == slot
    assert layout.qtypes == tuple(t.name for t in qtypes)
    run = jax.jit(lambda rows, which: dequantize_slots(rows, which, layout))
    for which, qtype in enumerate(qtypes):
        rows = random_rows(qtype, 3, 512, seed=which)
        slots = to_slots(rows, qtype, layout)
        assert slots.shape == (3, 512 // slot[0] * slot[1])
        np.testing.assert_array_equal(np.asarray(run(slots, np.int32(which))),
                                      gguf.quants.dequantize(rows, qtype))
