"""vLLM's logits processing written out in numpy, the reference the sampler is checked against.

It follows `vllm/v1/sample/sampler.py` step by step: the allow-list (-inf elsewhere), bad words
(`ops/bad_words.py`: the last token of a word is -inf when the rest ends the output), logit
bias (added), then `ops/penalties.py`: repetition over prompt and output tokens (a positive
logit divided by the penalty, a negative one multiplied), frequency (times the output count),
presence (once per token in the output).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler import SamplingParams


def reference_logits(logits: np.ndarray, sp: SamplingParams, prompt: Sequence[int],
                     output: Sequence[int], bad_words: Sequence[Sequence[int]] = ()
                     ) -> np.ndarray:
    """One row's processed logits (f32[V])."""
    x = np.asarray(logits, np.float32).copy()
    V = x.shape[0]
    if sp.allowed_token_ids is not None:
        mask = np.ones(V, bool)
        mask[list(sp.allowed_token_ids)] = False
        x[mask] = -np.inf
    for w in bad_words:
        if len(w) > len(output) + 1:
            continue
        prefix = list(w[:-1])
        if list(output[len(output) - len(prefix):]) == prefix or not prefix:
            x[w[-1]] = -np.inf
    for t, b in (sp.logit_bias or {}).items():
        x[t] += np.float32(b)
    counts = np.bincount(np.asarray(output, np.int64), minlength=V).astype(np.float32)
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    rep = np.where(seen, np.float32(sp.repetition_penalty), np.float32(1.0))
    x = np.where(x > 0, x / rep, x * rep)
    x = x - np.float32(sp.frequency_penalty) * counts
    return (x - np.float32(sp.presence_penalty) * (counts > 0)).astype(np.float32)
