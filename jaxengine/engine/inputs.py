"""What a request brings into the engine, checked before anything changes: the prompt (text,
a prompt dict or token ids) and the sampling parameters against what only this engine knows
(its tokenizer, vocabulary, logprobs cap and KV pool). Each check raises `ValueError` (or
`SamplingParamsError`, naming the field) with what to change."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from jaxengine.engine.detokenizer import StreamingTokenizer
from jaxengine.sampling.rows import validate_sampling_params
from jaxengine.structured.params import StructuredOutputsParams
from scheduler import SamplingParams, SamplingParamsError, SchedulerConfig

PromptType = str | Mapping[str, Any] | Sequence[int]


class TokenizerLike(StreamingTokenizer, Protocol):
    """What the engine needs of a tokenizer (`jaxengine.loading.tokenizer.Tokenizer` is one):
    the detokenizer's decoding, plus encoding prompts and the EOS id."""

    @property
    def eos_token_id(self) -> int | None:
        """The id that ends generation (unless `ignore_eos`)."""
        ...

    @property
    def eos_token_ids(self) -> Sequence[int]:
        """Every id that ends generation: `eos_token_id` first, then the model's others."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt."""
        ...


def resolve_prompt(prompt: PromptType, tokenizer: TokenizerLike | None, vocab_size: int
                   ) -> tuple[str | None, list[int]]:
    """A prompt's text (None if given as ids only) and its checked token ids.

    Raises:
      ValueError: a malformed prompt, text without a tokenizer, ids outside the vocabulary.
    """
    if isinstance(prompt, str):
        return prompt, _encode(prompt, tokenizer)
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or not prompt:
            raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids'; got keys "
                             f"{sorted(prompt)}")
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            return text, _check_ids(prompt["prompt_token_ids"], vocab_size)
        if not isinstance(text, str):
            raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
        return text, _encode(text, tokenizer)
    return None, _check_ids(prompt, vocab_size)


def _encode(text: str, tokenizer: TokenizerLike | None) -> list[int]:
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): pass "
                         "the prompt as {'prompt_token_ids': [...]}, not as text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # the tokenizer would fail with a cryptic TypeError
        raise ValueError(f"the prompt text holds a lone surrogate ({text[e.start]!a} at "
                         f"index {e.start}), which is not valid Unicode; pass valid "
                         f"text") from None
    return list(tokenizer.encode(text))


def _check_ids(ids: Any, vocab_size: int) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | Iterable):
        raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
    ids = list(ids)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids must be ints in [0, {vocab_size}), got {t!r}")
    return ids


def check_params(params: SamplingParams, *, max_logprobs: int, vocab_size: int,
                 has_tokenizer: bool) -> None:
    """What only the engine knows: its logprobs cap, the vocabulary, whether it has a
    tokenizer (bad_words are checked as they are tokenized; a grammar's need of the tokenizer
    where the engine builds its compiler)."""
    validate_sampling_params(params, max_logprobs=max_logprobs, vocab_size=vocab_size)
    if params.stop and not has_tokenizer:  # vLLM ignores them silently; say so
        raise SamplingParamsError(
            "stop strings need a tokenizer, and this engine has none "
            "(skip_tokenizer_init=True): use stop_token_ids instead", param="stop",
            value=params.stop)
    so = params.structured_outputs
    if so is not None and not isinstance(so, StructuredOutputsParams):
        raise SamplingParamsError(
            f"structured_outputs must be a StructuredOutputsParams (from jaxengine import "
            f"StructuredOutputsParams), got {type(so).__name__}", param="structured_outputs",
            value=so)
    if params.bad_words and not has_tokenizer:
        raise SamplingParamsError(
            "bad_words need a tokenizer, and this engine has none "
            "(skip_tokenizer_init=True): ban single tokens with logit_bias or "
            "allowed_token_ids instead", param="bad_words", value=params.bad_words)


def with_model_eos(params: SamplingParams, eos_token_ids: Sequence[int]) -> SamplingParams:
    """`params` that also stop on the model's EOS ids beyond the tokenizer's own (a
    generation_config.json's `eos_token_id` list: Llama 3's end of turn, say), as vLLM's
    `update_from_generation_config` adds them to `stop_token_ids`; unchanged with
    `ignore_eos` or no extra ids."""
    extra = [i for i in eos_token_ids[1:] if i not in params.stop_token_ids]
    if params.ignore_eos or not extra:
        return params
    return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))


def check_fits_pool(request_id: str, num_prompt_tokens: int, params: SamplingParams,
                    cfg: SchedulerConfig) -> None:
    """A request whose longest sequence needs more blocks than the whole pool can never run."""
    longest = min(num_prompt_tokens + (params.max_tokens or cfg.max_model_len),
                  cfg.max_model_len)
    need = -(-longest // cfg.block_size)
    if need > cfg.num_blocks - 1:
        raise ValueError(
            f"request {request_id!r} can never fit the KV pool: {longest} tokens need {need} "
            f"blocks of {cfg.block_size}, the pool has {cfg.num_blocks - 1}; lower max_tokens "
            f"or raise num_gpu_blocks_override / the KV memory budget")
