"""The OpenAI and vLLM request fields this server knows but cannot honour, and why.

Nothing is silently ignored: a field the request models do not declare is a 400 naming it
(`extra="forbid"`), and each field here is declared on its model but refused with a 400 naming
it unless its value asks for nothing (`neutral`: e.g. `function_call: "none"`,
`response_format: {"type": "text"}`, `use_beam_search: false`). `None` is always neutral.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class Refused(NamedTuple):
    """A known field we cannot honour: the values that ask for nothing, and what to do."""

    neutral: tuple[Any, ...]
    reason: str


# Fields of both /v1/completions and /v1/chat/completions (vLLM's names).
COMMON: Mapping[str, Refused] = {
    "use_beam_search": Refused((False,), "beam search is not available; leave it false"),
    "length_penalty": Refused((1.0,), "it applies to beam search only, which is not "
                                      "available; leave it at 1.0"),
    "guided_decoding_backend": Refused(("auto", "guidance"), "structured outputs always use "
                                       "llguidance; leave it unset (or \"guidance\")"),
    "logits_processors": Refused((), "custom logits processors are not available"),
    "spaces_between_special_tokens": Refused(
        (True,), "the detokenizer always joins special tokens as the tokenizer does; leave "
                 "it true"),
    "cache_salt": Refused((), "the prefix cache has no per-request salt"),
    "vllm_xargs": Refused((), "this server has no extensions that read them"),
    # OpenAI: storing completions for distillation/evals. Nothing is stored here.
    "store": Refused((False,), "this server stores no completions; leave it false"),
    # OpenAI's processing tiers: this server has one, which is what "auto" and "default" ask.
    "service_tier": Refused(("auto", "default"), "this server has one tier; send \"auto\" or "
                                                 "\"default\""),
}

COMPLETION: Mapping[str, Refused] = {
    **COMMON,
    "suffix": Refused((), "suffix (insertion) is not supported, as in vLLM"),
    "prompt_embeds": Refused((), "prompt embeddings are not accepted; send text or token ids"),
}

CHAT: Mapping[str, Refused] = {
    **COMMON,
    "parallel_tool_calls": Refused((), "it is not honoured: with tool_choice \"required\" the "
                                       "model makes one call or more; leave it unset"),
    "functions": Refused(([],), "the deprecated functions API is not available; send tools "
                                "and a named or \"required\" tool_choice"),
    "function_call": Refused(("none",), "the deprecated functions API is not available"),
    "structural_tag": Refused((), "structural tags are not supported; constrain the output "
                                  "with response_format, structured_outputs or guided_*"),
    "reasoning_effort": Refused((), "this server has no reasoning controls"),
    "include_reasoning": Refused((True,), "this server has no reasoning parser: the reasoning "
                                          "text, if any, is part of the content"),
    "verbosity": Refused((), "this server has no verbosity control"),
    "audio": Refused((), "audio output is not available"),
    "modalities": Refused((["text"],), "only text output is available"),
    "prediction": Refused((), "predicted outputs are not available"),
    "web_search_options": Refused((), "web search is not available"),
    "moderation": Refused((), "moderation is not available"),
    "mm_processor_kwargs": Refused((), "multimodal inputs are not available"),
    "prompt_cache_retention": Refused(("in_memory",), "the prefix cache lives in memory only"),
    "prompt_cache_options": Refused((), "the prefix cache has no per-request options"),
}


def is_neutral(value: Any, refused: Refused) -> bool:
    """True if `value` asks for nothing (None, or one of the field's neutral values)."""
    if value is None:
        return True
    # bool is an int in Python: only a bool matches a bool, only a number matches a number.
    return any(type(value) is type(n) or (_is_number(value) and _is_number(n))
               for n in refused.neutral if value == n)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
