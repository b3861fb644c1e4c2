"""OpenAI request bodies (pydantic) and their translation into `SamplingParams`.

Field names and defaults follow OpenAI's API plus vLLM's extra sampling fields (`top_k`,
`min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `priority`) and one jaxengine extension, `tenant`: with OpenAI's `user` it
goes into the request's `metadata` for scheduling policies such as `fair`
(docs/SCHEDULING.md §8). Unknown fields are ignored, as vLLM does; fields we cannot
honour (n > 1, penalties, echo) are rejected. A sampling field the request leaves unset takes
the model's default (its generation_config.json, `jaxengine.loading.generation_config`), else
`SamplingParams`' own, as vLLM's `to_sampling_params` does. `SamplingParams` checks the values;
its error names our field, which `request_error` turns into the request's field name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler import SamplingParams, SamplingParamsError

# Request fields that, when unset, take the model's default (the loader gives no others but
# max_tokens, which `resolve_max_tokens` handles).
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p")


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


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` is honoured."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
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
    priority: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # OpenAI's end-user id: metadata["user"]
    tenant: str | None = None  # jaxengine extension: metadata["tenant"] (the `fair` policy)

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
        """Reject what the engine cannot do."""
        if self.n != 1:
            raise RequestError(f"only n=1 is supported, got n={self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported (use 0 or leave it out)", name)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters: each field as the request set it, else the model's default.

        Args:
          max_tokens: from `resolve_max_tokens`.
          logprobs: top logprobs per token (None: none).
          defaults: the model's defaults by `SamplingParams` field (`diff_sampling_params`);
            only those in `MODEL_DEFAULTED` are taken here.
        Raises:
          RequestError: a value `SamplingParams` refuses, naming the request's field.
        """
        chosen = {n: getattr(self, n) for n in MODEL_DEFAULTED if getattr(self, n) is not None}
        unset = {n: v for n, v in (defaults or {}).items()
                 if n in MODEL_DEFAULTED and n not in chosen}
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                stop_token_ids=self.stop_token_ids, stop=self.stop, seed=self.seed,
                logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, **unset, **chosen)
        except SamplingParamsError as e:
            raise self.request_error(e) from None

    def metadata(self) -> dict[str, str]:
        """The scheduler request's metadata: `user` and `tenant`, where the body sets them."""
        return {name: value for name in ("user", "tenant")
                if (value := getattr(self, name)) is not None}

    def request_error(self, error: SamplingParamsError) -> RequestError:
        """`error` as a 400 whose `param` is this request's name for the field."""
        name = self.PARAM_NAMES.get(error.param, error.param)
        message = str(error) if name == error.param else f"{error} (sent as '{name}')"
        return RequestError(message, name)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); batches of prompts are rejected."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise RequestError(f"send one prompt per request (got {len(p)})", "prompt")
            p = p[0]
        if not p:
            raise RequestError("the prompt is empty", "prompt")
        if self.echo:
            raise RequestError("echo is not supported", "echo")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        return p


class TextPart(BaseModel):
    """A `{"type": "text", "text": ...}` content part."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict[str, Any]:
        """`{"role", "content"}` with text parts joined, for the chat template."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    # chat's `logprobs` is a switch; the count SamplingParams calls logprobs is top_logprobs
    PARAM_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, else the deprecated `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top-n logprobs per token for the engine (None: none asked).

        Its range is checked where `logprobs` is (SamplingParams, the engine's cap), and
        `request_error` names `top_logprobs` in the error.
        """
        n = self.top_logprobs
        if n is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        return (n or 0) if self.logprobs else None


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, *,
                       prompt_param: str, default: int | None = None) -> int:
    """`requested`, checked against the context.

    None takes `default` (the model's `max_new_tokens`) capped to what is left of the context,
    or all that is left without one (vLLM's `get_max_tokens`).
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens; "
                           f"the prompt has {prompt_len} tokens. Shorten the prompt.", prompt_param)
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
