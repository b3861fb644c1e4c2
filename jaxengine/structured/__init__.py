"""Structured outputs (vLLM's `structured_outputs`): grammars, matchers and token bitmasks.

A request's `StructuredOutputsParams` (validated when built) is compiled against the model's
tokenizer by a `GrammarCompiler` in a thread pool, with a cache; while it compiles the request
waits as `WAITING_FOR_FSM` (docs/SCHEDULING.md §12). Each step, `fill_bitmasks` writes an
i32[R, ceil(V/32)] bitmask from the requests' `GrammarMatcher`s, `apply_token_bitmask` masks the
logits with it on the device, and the sampled tokens are fed back with `accept_tokens`.
Built on llguidance (no torch).
"""

from jaxengine.structured.apply import apply_token_bitmask
from jaxengine.structured.bitmask import allocate_bitmask, bitmask_width, fill_bitmasks
from jaxengine.structured.compiler import CompiledGrammar, GrammarCompiler
from jaxengine.structured.matcher import GrammarMatcher
from jaxengine.structured.params import StructuredOutputsError, StructuredOutputsParams

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "StructuredOutputsError",
           "StructuredOutputsParams", "allocate_bitmask", "apply_token_bitmask", "bitmask_width",
           "fill_bitmasks"]
