"""`apply_token_bitmask`: mask logits with a step's token bitmask, on the device (jnp).

Pure and shape-static, so it can sit inside the jitted sampler: the bitmask is one i32[R, W]
array per step (jaxengine/structured/bitmask.py); rows without a grammar are all ones.
"""

import jax
import jax.numpy as jnp


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set the logits of disallowed tokens to -inf.

    Args:
        logits: f32[R, V] (any float dtype; kept).
        bitmask: i32[R, W]; bit t % 32 of word t // 32 is set when token t is allowed. With
            32 * W < V the tokens past 32 * W are disallowed; with 32 * W > V the extra bits
            are ignored.
    Returns:
        f32[R, V]: `logits` where allowed, -inf elsewhere.
    """
    r, v = logits.shape
    w = bitmask.shape[1]
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # i32[R, W, 32], arithmetic shift masked to 1
    allowed = bits.reshape(r, w * 32).astype(jnp.bool_)  # bool[R, 32W]
    # bool[R, V]: extra bits dropped, or missing ones padded with False
    allowed = allowed[:, :v] if w * 32 >= v else jnp.pad(allowed, ((0, 0), (0, v - w * 32)))
    return jnp.where(allowed, logits, jnp.array(-jnp.inf, logits.dtype))
