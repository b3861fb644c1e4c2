"""`GrammarCompiler`: structured-outputs params compiled against the model's tokenizer.

Compiling a grammar builds llguidance's lexer and parser tables for one tokenizer; for a large
JSON schema that can take tens of milliseconds or more, so it runs in a thread pool
(llguidance releases the GIL while it compiles) and the engine keeps stepping meanwhile: the
request waits as `WAITING_FOR_FSM` (docs/SCHEDULING.md §12) until its future is done. Results
are cached by the params' `key` (kind, grammar text), so the same schema compiles once.
"""

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.structured.bitmask import bitmask_width
from jaxengine.structured.matcher import GrammarMatcher
from jaxengine.structured.params import (
    StructuredOutputsError,
    StructuredOutputsParams,
    llguidance_reason,
)


class CompiledGrammar:
    """A grammar compiled for one tokenizer (immutable); each request gets its own matcher."""

    def __init__(self, template: llguidance.LLMatcher, eos_token_ids: Sequence[int]) -> None:
        self._template = template  # never advanced: matchers are copies of it
        self._eos = tuple(eos_token_ids)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar, for one request."""
        return GrammarMatcher(self._template.deep_copy(), self._eos)


class _DecodedTokens:
    """llguidance's generic tokenizer interface (`llguidance.TokenizerWrapper`): each token as
    the UTF-8 of its decoded text; special tokens as llguidance marks them (a 0xFF byte, then
    the name), so no grammar text can spell them."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int) -> None:
        hf = tokenizer.hf
        self.eos_token_id = eos_token_id
        self.bos_token_id = hf.bos_token_id
        self.special_token_ids = sorted(set(hf.all_special_ids))
        special = set(self.special_token_ids)
        size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        self.tokens = [b"\xff" + hf.convert_ids_to_tokens(i).encode() if i in special
                       else hf.decode([i]).encode() for i in range(size)]
        self._hf = hf

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)


def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int | None,
                  eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer: from its HF description, or, for a decoder that
    llguidance does not know (e.g. a character-level `Fuse`), from each token's decoded text."""
    # imported on the first grammar, not with the package: llguidance.hf imports transformers
    # (~0.7 s), which `import jaxengine` spares (docs/STYLE.md rule 19)
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size,
                                            eos_token=list(eos_token_ids))
    except ValueError as e:
        if "decoder type" not in str(e):
            raise
    wrapper = llguidance.TokenizerWrapper(_DecodedTokens(tokenizer, eos_token_ids[0]))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer, asynchronously, with a cache."""

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, max_workers: int = 2,
                 cache_size: int = 256) -> None:
        """Build llguidance's view of the tokenizer (about 0.3 s for a 49k vocabulary).

        Args:
            tokenizer: the model's tokenizer; its `eos_token_ids` end a finished grammar.
            eos_token_ids: the tokens a finished grammar allows, when not the tokenizer's (the
                engine gives the one its scheduler stops on).
            vocab_size: V, the width of the model's logits (default: the tokenizer's size); it
                may exceed the tokenizer's (padded embeddings): the extra ids are never allowed.
            max_workers: compile threads.
            cache_size: compiled grammars kept (least recently used ones are dropped).
        Raises:
            ValueError: vocab_size below the tokenizer's size, or bad counts.
        """
        if max_workers < 1 or cache_size < 1:
            raise ValueError(f"GrammarCompiler: max_workers={max_workers} and "
                             f"cache_size={cache_size} must both be >= 1")
        size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and vocab_size < size:
            raise ValueError(f"GrammarCompiler: vocab_size={vocab_size} is below the "
                             f"tokenizer's {size} tokens; give the model's logits width")
        self.eos_token_ids = tuple(tokenizer.eos_token_ids if eos_token_ids is None
                                   else eos_token_ids)
        self.ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, self.eos_token_ids)
        self.vocab_size: int = self.ll_tokenizer.vocab_size  # V
        self.executor = llguidance.LLExecutor()  # fills a batch's bitmask rows in parallel
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache is shared by callers and compile threads

    @property
    def bitmask_width(self) -> int:
        """W = ceil(V / 32): int32 words per bitmask row."""
        return bitmask_width(self.vocab_size)

    def submit(self, params: StructuredOutputsParams) -> "Future[CompiledGrammar]":
        """Start compiling (or find the cached result). The future's `result()` is the
        `CompiledGrammar`, or raises `StructuredOutputsError` if llguidance refuses the grammar
        for this tokenizer."""
        with self._lock:
            future = self._cache.get(params.key)
            if future is not None:
                self._cache.move_to_end(params.key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[params.key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile and wait (`submit(params).result()`)."""
        return self.submit(params).result()

    def shutdown(self) -> None:
        """Stop the compile threads: queued compilations are cancelled (their futures say
        so), a running one ends first. Idempotent; `submit` raises afterwards."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        template = llguidance.LLMatcher(self.ll_tokenizer, params.llguidance_grammar,
                                        log_level=0)
        if template.is_error():
            name = f"structured_outputs.{params.kind}"
            raise StructuredOutputsError(
                f"{name}: the grammar does not compile for this model's tokenizer, change it: "
                f"{llguidance_reason(template.get_error())}", param=name,
                value=getattr(params, params.kind))
        return CompiledGrammar(template, self.eos_token_ids)
