"""Raw logprobs of given tokens, their ranks and the top k: what the sampler reports for the
tokens it draws and prompt logprobs for the prompt's tokens (vLLM's raw logprobs).

Axis names: N rows, V vocabulary, k top logprobs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.model.reductions import log_softmax


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each row's `log_softmax` (in float32) at its token, the token's rank, and the top k.
    The sum runs in an order fixed by V, so a row's logprobs do not depend on the rows beside it
    (`jaxengine.model.reductions`).

    Args:
      logits: [N, V] logits.
      tokens: i32[N] one token id per row, in [0, V).
      num_top: k (static: it sets the output shapes).
    Returns:
      ``(logprobs f32[N], ranks i32[N], top_logprobs f32[N, k], top_token_ids i32[N, k])``;
      a rank is 1 + the tokens strictly more likely, the top k are best first.
    """
    N = logits.shape[0]
    raw = log_softmax(logits.astype(jnp.float32))
    lp = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(raw > lp[:, None], axis=-1, dtype=jnp.int32)
    if not num_top:
        return lp, rank, jnp.zeros((N, 0), jnp.float32), jnp.zeros((N, 0), jnp.int32)
    top_lp, top_ids = lax.top_k(raw, num_top)
    return lp, rank, top_lp, top_ids.astype(jnp.int32)
