"""The grammars of structured-output requests over their life in the engine: compiled off the
loop by the engine's `GrammarCompiler` (the request waits as WAITING_FOR_FSM meanwhile), then
a matcher per request that accepts every sampled token on the host, from which the runner
fills the request's bitmask row (docs/DESIGN.md, "Structured outputs")."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping, Sequence

import jax

from jaxengine.engine.inputs import TokenizerLike
from jaxengine.engine.request_state import TrackedRequest
from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.runner.in_flight import SampledToken
from jaxengine.structured.compiler import CompiledGrammar, GrammarCompiler
from jaxengine.structured.params import StructuredOutputsError, StructuredOutputsParams
from scheduler import SamplingParamsError

logger = logging.getLogger("jaxengine.engine")


class Grammars:
    """The engine's grammar compiler (built on first use) and the compilations in progress."""

    def __init__(self, tokenizer: TokenizerLike | None, *, vocab_size: int,
                 eos_token_id: int | None,
                 on_compiler: Callable[[GrammarCompiler], None] | None = None) -> None:
        """Args:
          tokenizer: the engine's tokenizer (structured outputs need a real `Tokenizer`).
          vocab_size: the model's vocabulary (the bitmask's width).
          eos_token_id: the EOS a finished grammar allows (the scheduler stops on it).
          on_compiler: called with the compiler once it is built (the runner takes its
            executor to fill bitmask rows in parallel).
        """
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._on_compiler = on_compiler
        self._compiler: GrammarCompiler | None = None
        self._compiling: dict[str, concurrent.futures.Future[CompiledGrammar]] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler (built on first use).

        Raises:
          SamplingParamsError: the engine has no tokenizer.
        """
        if self._compiler is None:
            if not isinstance(self._tokenizer, Tokenizer) or self._eos_token_id is None:
                raise SamplingParamsError(
                    "structured outputs need the model's tokenizer (with an EOS token), and "
                    "this engine has none (skip_tokenizer_init=True, or a stand-in): leave "
                    "structured_outputs unset", param="structured_outputs")
            self._compiler = GrammarCompiler(self._tokenizer, vocab_size=self._vocab_size,
                                             eos_token_ids=(self._eos_token_id,))
            if self._on_compiler is not None:
                self._on_compiler(self._compiler)
        return self._compiler

    @property
    def num_compiling(self) -> int:
        """Requests whose grammar is still compiling."""
        return len(self._compiling)

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start compiling a request's grammar (under multi-host lockstep: wait for it, so
        every host sees it ready at the same step)."""
        future = self.compiler.submit(params)
        if jax.process_count() > 1:
            concurrent.futures.wait([future])
        self._compiling[request_id] = future

    def shutdown(self) -> None:
        """Stop the compiler's threads, if it was built (`GrammarCompiler.shutdown`)."""
        if self._compiler is not None:
            self._compiler.shutdown()

    def forget(self, request_id: str) -> None:
        """A request left (aborted): its compilation's result is not wanted."""
        self._compiling.pop(request_id, None)

    def samples_a_grammar(self, tracked: Mapping[str, TrackedRequest],
                          sampling_ids: Sequence[str]) -> bool:
        """Whether any of these sampling requests has a grammar (none can before the compiler
        is built: the per-request look is skipped)."""
        return self._compiler is not None and any(tracked[r].grammar is not None
                                                  for r in sampling_ids)

    def accept_sampled(self, tracked: Mapping[str, TrackedRequest],
                       sampled: Mapping[str, Sequence[SampledToken]]) -> None:
        """Advance each grammar past its request's sampled token (before the update: a
        terminated grammar has accepted the EOS the scheduler stops on; a grammar request gets
        no drafts, so it has one). Nothing to do before the compiler is built."""
        if self._compiler is None:
            return
        for rid, (token, *_) in sampled.items():
            grammar = tracked[rid].grammar
            if grammar is not None and not grammar.accept_tokens([token.token_id]):
                logger.warning("request %r: the grammar refused sampled token %d: %s", rid,
                               token.token_id, grammar.error)

    def take_compiled(self, tracked: Mapping[str, TrackedRequest], *, wait: bool
                      ) -> tuple[list[str], list[str]]:
        """The requests whose compilation finished: (ready, each now with its matcher;
        failed, logged). With `wait` (nothing else to do) wait up to a second for one."""
        if wait and self._compiling:
            concurrent.futures.wait(self._compiling.values(), timeout=1.0,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        for rid in [r for r, f in self._compiling.items() if f.done()]:
            future = self._compiling.pop(rid)
            try:
                tracked[rid].grammar = future.result().matcher()
                ready.append(rid)
            except StructuredOutputsError as e:
                logger.error("request %r aborted: %s", rid, e)
                failed.append(rid)
        return ready, failed

