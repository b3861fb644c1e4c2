"""`GrammarMatcher`: one request's position in its grammar (vLLM's `GuidanceGrammar`).

It fills the token bitmask row of the request's next token, accepts the tokens the request
samples, rolls back rejected draft tokens, and says when the grammar is finished. It is not
thread-safe: one request's matcher is used by one thread at a time.
"""

from collections.abc import Sequence

import llguidance
import numpy as np


class GrammarMatcher:
    """The grammar state of one request; build it with `CompiledGrammar.matcher()`."""

    def __init__(self, ll_matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int]) -> None:
        """Wrap an llguidance matcher at the start of its grammar.

        Args:
            ll_matcher: a fresh llguidance matcher (not shared with another request).
            eos_token_ids: the tokens that end generation; the grammar allows them only where
                its text is complete.
        """
        self._m = ll_matcher
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._terminated = False  # an EOS token was accepted: the request stops
        self._rollback_lag = 0  # 1: the last EOS was accepted while stopped, not consumed

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher (for the batch fill, jaxengine/structured/bitmask.py)."""
        return self._m

    @property
    def is_terminated(self) -> bool:
        """True once an EOS token was accepted where the grammar is complete: stop the
        request (vLLM's `is_terminated`)."""
        return self._terminated

    @property
    def is_accepting(self) -> bool:
        """True where the text so far is a complete match (EOS would be allowed next)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token it did not allow was accepted), else None."""
        return self._m.get_error() or None

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (i32[ceil(V/32)], bit t % 32 of word
        t // 32 set for an allowed token t). A finished grammar allows only EOS."""
        if row.dtype != np.int32 or row.ndim != 1 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask row: need a contiguous i32[W] array, got {row.dtype}"
                             f"{list(row.shape)}")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance past the tokens the request sampled (1, or more under speculative decoding).

        Returns:
            False if the grammar did not allow one of them (the matcher is then in error and
            `error` says why); True otherwise, including for tokens after termination.
        """
        if self._eos.intersection(token_ids):
            if self._m.is_stopped() and not self._terminated:
                self._rollback_lag = 1  # llguidance does not consume an EOS once stopped
            self._terminated = True
        if self._m.is_stopped():
            return not self._m.is_error()
        return self._m.consume_tokens(list(token_ids))

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` (draft tokens) the grammar allows from here,
        without advancing."""
        if not token_ids or self._m.is_stopped():
            return 0
        return self._m.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected drafts); it is no longer
        terminated."""
        if num_tokens < 0:
            raise ValueError(f"rollback: num_tokens={num_tokens}; give a count >= 0")
        if num_tokens:
            self._m.rollback(num_tokens - self._rollback_lag)
            self._terminated = False
            self._rollback_lag = 0
