"""OpenAI request bodies (pydantic) and their translation into `SamplingParams`: the shared
sampling fields and /v1/completions (the chat bodies: `jaxengine.server.chat_protocol`; the
response bodies: `jaxengine.server.response_bodies`).

Field names and defaults follow OpenAI's API plus vLLM's extra sampling fields (`top_k`,
`min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `priority`, ...) and one jaxengine extension, `tenant`: with OpenAI's
`user` and `metadata` it goes into the request's `metadata` for scheduling policies such as
`fair` (docs/SCHEDULING.md §8). Nothing is silently ignored: an unknown field is a 400 naming it
(`extra="forbid"`; vLLM only logs it), and a known field we cannot honour is declared here and
refused with a 400 naming it unless its value asks for nothing (`jaxengine.server.refused`).
A sampling field the request leaves unset takes
the model's default (its generation_config.json, `jaxengine.loading.generation_config`), else
`SamplingParams`' own, as vLLM's `to_sampling_params` does. `SamplingParams` checks the values;
its error names our field, which `request_error` turns into the request's field name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from jaxengine.server import refused
from jaxengine.server.refused import Refused
from scheduler import SamplingParams, SamplingParamsError

# Request fields that, when unset, take the model's default (the loader gives no others but
# max_tokens, which `resolve_max_tokens` handles).
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class RequestError(ValueError):
    """A bad request; `param` names the offending field when known, `code` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, *, code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def has_lone_surrogate(value: Any) -> bool:
    """True if any string in `value` (nested lists, dicts, models) holds a lone surrogate.

    JSON's `"\\ud800"` escape parses to one: not valid Unicode, so it can be neither tokenized
    nor sent back as UTF-8. (A valid escaped pair such as `"\\ud83d\\ude00"` parses to one
    character and passes.)
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, BaseModel):
        return any(has_lone_surrogate(getattr(value, f)) for f in type(value).model_fields)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_lone_surrogate(v) for v in value)
    return False


class RequestModel(BaseModel):
    """A request body (or a part of one): unknown fields are refused, and an explicit `null`
    for a field that cannot be null means "not set" (OpenAI's and vLLM's reading), so
    `"stream": null` is `false`; a field that can be null keeps it (`"max_tokens": null`).

    Types are strict, as OpenAI's API is: `"max_tokens": true` or `"stream": "yes"` is a 400
    naming the field, not one token or a stream (pydantic's lax mode converts them). A JSON
    integer is still a number (`"temperature": 1`).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields or _nullable(cls.model_fields[k])}


def _nullable(info: FieldInfo) -> bool:
    return info.annotation is Any or type(None) in get_args(info.annotation)


class StreamOptions(RequestModel):
    """`stream_options`: `include_usage` and vLLM's `continuous_usage_stats` are honoured."""

    include_usage: bool = True  # vLLM's default once stream_options is sent
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far
    # OpenAI pads deltas with random characters when true; this server does not.
    include_obfuscation: Literal[False] | None = None


class SamplingFields(RequestModel):
    """The fields both endpoints share."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None  # vLLM V1: only best_of == n (no extra samples to rank)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None  # keep the last k
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N"
    request_id: str | None = None  # vLLM: the response's id is made from it
    priority: int = 0
    user: str | None = None  # OpenAI's end-user id: metadata["user"]
    safety_identifier: str | None = None  # OpenAI's newer end-user id: metadata too
    tenant: str | None = None  # jaxengine extension: metadata["tenant"] (the `fair` policy)
    # OpenAI: up to 16 string pairs labelling the request; carried into its metadata (below
    # user and tenant, which win), where scheduling policies can read them.
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    # OpenAI: a routing hint for its prompt caches. Accepted: our prefix cache matches prompts
    # by content whatever the key, and no output depends on it.
    prompt_cache_key: str | None = None

    presence_penalty: float | None = None  # None: 0 (OpenAI's default)
    frequency_penalty: float | None = None  # None: 0
    repetition_penalty: float | None = None  # None: the model's default, else 1 (vLLM's)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM: the top-n logprobs of each prompt token (the engine's `prompt_logprobs`), returned
    # beside the choices; not with stream (vLLM's rule)
    prompt_logprobs: int | None = None

    # What constrains the output (`jaxengine.server.structured`, which checks them).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None

    # vLLM's prefill/decode disaggregation: {"do_remote_decode": true} to a prefill instance,
    # the handle its response carries to a decode instance (the engine checks it).
    kv_transfer_params: dict[str, Any] | None = None

    # Known fields we cannot honour (`jaxengine.server.refused`).
    use_beam_search: Any = None
    length_penalty: Any = None
    guided_decoding_backend: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    cache_salt: Any = None
    vllm_xargs: Any = None
    store: Any = None
    service_tier: Any = None

    REFUSED: ClassVar[Mapping[str, Refused]] = refused.COMMON
    # SamplingParams field -> this request's field, where the two names differ
    PARAM_NAMES: ClassVar[dict[str, str]] = {}

    def check_text(self) -> None:
        """Reject text that is not valid Unicode, naming the field (before anything echoes it)."""
        for name in type(self).model_fields:
            if has_lone_surrogate(getattr(self, name)):
                raise RequestError(
                    f"'{name}' contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                    f"escape), which is not valid Unicode text; send valid characters (an "
                    f"escaped pair such as \\ud83d\\ude00 is fine)", name)

    def check_supported(self) -> None:
        """Reject the known fields we cannot honour, and values vLLM refuses, naming each."""
        for name, why in type(self).REFUSED.items():
            value = getattr(self, name)
            if not refused.is_neutral(value, why):
                raise RequestError(f"'{name}' is not supported by this server "
                                   f"({why.reason}); got {value!r}", name)
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n}", "n")
        if self.kv_transfer_params is not None and self.n != 1:
            raise RequestError(f"kv_transfer_params need n=1 (one sequence's KV is handed "
                               f"on), got n={self.n}", "kv_transfer_params")
        if self.stream and (self.kv_transfer_params or {}).get("do_remote_decode"):
            raise RequestError("kv_transfer_params with do_remote_decode need stream=false: "
                               "the handle to the KV comes in the response body",
                               "kv_transfer_params")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of must equal n (got best_of={self.best_of}, n={self.n}): "
                               f"as in vLLM V1, no extra samples are drawn to rank", "best_of")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options can only be defined when stream=true",
                               "stream_options")
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < 0:  # vLLM's -1 (the whole vocabulary) too
                raise RequestError(f"prompt_logprobs must be an integer >= 0 (the top "
                                   f"logprobs per prompt token), got {self.prompt_logprobs}",
                                   "prompt_logprobs")
            if self.stream and self.prompt_logprobs > 0:
                raise RequestError("`prompt_logprobs` are not available when `stream=True` "
                                   "(as in vLLM): send stream=false, or leave it unset",
                                   "prompt_logprobs")

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: Mapping[str, Any] | None = None, *,
                        structured_outputs: Any = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters: each field as the request set it, else the model's default
        (`n` too: `jaxengine.engine.parallel_sampling.child_params` fans them out).

        Args:
          max_tokens: from `resolve_max_tokens`.
          logprobs: top logprobs per token (None: none).
          defaults: the model's defaults by `SamplingParams` field (`diff_sampling_params`);
            only those in `MODEL_DEFAULTED` are taken here.
          structured_outputs: the output constraint (`jaxengine.server.structured`).
          prompt_logprobs: top logprobs per prompt token (None: none).
        Raises:
          RequestError: a value `SamplingParams` refuses, naming the request's field.
        """
        chosen = {n: getattr(self, n) for n in MODEL_DEFAULTED if getattr(self, n) is not None}
        unset = {n: v for n, v in (defaults or {}).items()
                 if n in MODEL_DEFAULTED and n not in chosen}
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids, stop=self.stop,
                seed=self.seed,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words, structured_outputs=structured_outputs,
                extra_args=(None if self.kv_transfer_params is None
                            else {"kv_transfer_params": self.kv_transfer_params}),
                **unset, **chosen)
        except SamplingParamsError as e:
            raise self.request_error(e) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` by token id (OpenAI's keys are the ids as strings)."""
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids (integers as strings, e.g. "
                               f"\"50256\"), got {list(self.logit_bias)!r}", "logit_bias"
                               ) from None

    def metadata_of_request(self) -> dict[str, str]:
        """The scheduler request's metadata: `metadata`, then `user`, `safety_identifier` and
        `tenant` where the body sets them."""
        named = {name: value for name in ("user", "safety_identifier", "tenant")
                 if (value := getattr(self, name)) is not None}
        return {**(self.metadata or {}), **named}

    def request_error(self, error: SamplingParamsError) -> RequestError:
        """`error` as a 400 whose `param` is this request's name for the field."""
        name = self.PARAM_NAMES.get(error.param, error.param)
        message = str(error) if name == error.param else f"{error} (sent as '{name}')"
        return RequestError(message, name)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (vLLM's extension)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt's text before each choice's
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS (etc.) on text prompts
    suffix: Any = None
    prompt_embeds: Any = None

    REFUSED: ClassVar[Mapping[str, Refused]] = refused.COMPLETION

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the prompt alone comes back (OpenAI's and vLLM's; the
        engine generates one token, which is not shown)."""
        return self.echo and self.max_tokens == 0

    def num_prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs: the field, else `logprobs` under `echo` (vLLM's rule:
        echoed prompt tokens carry logprobs as the completion's do)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (a batch gives one choice per prompt and n)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]
        if not batch or any(not one for one in batch):
            raise RequestError("the prompt is empty" if len(batch) <= 1 else
                               "a prompt of the list is empty", "prompt")
        return batch


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, *,
                       prompt_param: str, default: int | None = None) -> int:
    """`requested`, checked against the context.

    None takes `default` (the model's `max_new_tokens`) capped to what is left of the context,
    or all that is left without one (vLLM's `get_max_tokens`).
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise prompt_too_long(prompt_len, max_model_len, prompt_param)
    if requested is None:
        return room if default is None else min(default, room)
    if requested <= 0:
        raise RequestError(f"max_tokens must be at least 1, got {requested}", "max_tokens")
    if requested > room:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
            f"{requested} in the completion). Please reduce the length of the messages or "
            f"completion.", "max_tokens")
    return requested


def prompt_too_long(prompt_len: int, max_model_len: int, param: str) -> RequestError:
    """The 400 for a prompt of `prompt_len` tokens that leaves no room in the context."""
    return RequestError(f"This model's maximum context length is {max_model_len} tokens; the "
                        f"prompt has {prompt_len} tokens. Shorten the prompt.", param)
