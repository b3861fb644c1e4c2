"""The /v1/chat/completions request body: the messages, what renders them through the chat
template (shared with /tokenize's chat form), and chat's own fields on top of the sampling
fields of `jaxengine.server.protocol` (the response: `jaxengine.server.response_bodies`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from jaxengine.server import refused
from jaxengine.server.protocol import (
    RequestError,
    RequestModel,
    SamplingFields,
)
from jaxengine.server.refused import Refused

# transformers' rendering arguments (`PreTrainedTokenizerBase.apply_chat_template`'s, a test
# holds them to its signature), which chat_template_kwargs (template variables) may not set:
# they would change what rendering returns, or clash with the request's own fields. (vLLM
# refuses `chat_template` and `tokenize` there; `messages` is the template's own variable.)
# Spelled out, not read from the signature: importing transformers would cost the server's
# start most of a second (docs/BENCHMARKS.md §14).
_RENDER_ARGS = frozenset({
    "add_generation_prompt", "chat_template", "continue_final_message", "documents",
    "max_length", "padding", "return_assistant_tokens_mask", "return_dict", "return_tensors",
    "sanitize_control_tokens", "tokenize", "tokenizer_kwargs", "tools", "truncation",
    "messages"})
_REQUEST_FIELDS = ("messages", "chat_template", "add_generation_prompt", "continue_final_message",
                   "tools", "documents")


class TextPart(RequestModel):
    """A `{"type": "text", "text": ...}` content part."""

    type: Literal["text"]
    text: str


class ChatCompletionMessageParam(RequestModel):
    """One message of a request's conversation (OpenAI's name); `name`, `tool_calls` and
    `tool_call_id` go to the chat template as vLLM passes them (the template decides what to
    render)."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Say so when a part is not text (an image, audio, a file), not just "invalid"."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts ({{\"type\": \"text\", "
                                     f"\"text\": ...}}) are accepted, got type {kind!r}: "
                                     f"this server has no multimodal inputs")
        return content

    def text(self) -> str:
        """The content as one string (text parts joined, as vLLM joins them: by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def as_template_message(self) -> dict[str, Any]:
        """`{"role", "content", ...}` for the chat template."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if (value := getattr(self, key)) is not None:
                message[key] = value
        return message


class ChatTemplateFields(RequestModel):
    """What renders a conversation: shared by chat completions and /tokenize's chat form."""

    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]
    add_generation_prompt: bool = True
    # vLLM: render the last message open-ended, so the model continues it
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM: special tokens on top of the template's own
    chat_template: str | None = None  # a Jinja template for this request (transformers')
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    documents: list[dict[str, str]] | None = None  # the template's RAG documents, if it has any
    tools: list[dict[str, Any]] | None = None  # shown to the model by its chat template

    def check_chat_template(self, *, trusted: bool) -> None:
        """Refuse a chat template sent with the request unless the server trusts them (vLLM's
        --trust-request-chat-template: a template is Jinja the server runs), and template
        variables that are rendering arguments.

        Raises:
          RequestError: naming `chat_template` or `chat_template_kwargs`.
        """
        for key in sorted(_RENDER_ARGS & set(self.chat_template_kwargs or {})):
            instead = (f"send it as the request's '{key}' field" if key in _REQUEST_FIELDS
                       else "leave it out")
            raise RequestError(f"chat_template_kwargs may not set '{key}', which is an argument "
                               f"of the rendering, not a template variable: {instead}",
                               "chat_template_kwargs")
        if self.chat_template is not None and not trusted:
            raise RequestError("this server does not render chat templates sent with a request "
                               "(a template is code the server runs): leave 'chat_template' out "
                               "to use the model's own, or start the server with "
                               "--trust-request-chat-template", "chat_template")

    def num_chars(self) -> int:
        """The characters of the messages' text (what the rendered prompt has at least, when
        the template renders every message, as chat templates do)."""
        return sum(len(m.text()) for m in self.messages)

    def generation_prompt(self) -> bool:
        """`add_generation_prompt`, off when continuing the final message (and not set)."""
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise RequestError("cannot set both continue_final_message and "
                                   "add_generation_prompt to true", "continue_final_message")
            return False
        return self.add_generation_prompt

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's keyword arguments besides `add_generation_prompt`."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                raise RequestError("continue_final_message continues the last message, which "
                                   "must then be the assistant's", "continue_final_message")
            kwargs["continue_final_message"] = True
        for key in ("chat_template", "documents", "tools"):
            if (value := getattr(self, key)) is not None:
                kwargs[key] = value
        return kwargs


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    """POST /v1/chat/completions."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM: the last message's content before the reply, if the assistant's
    tool_choice: Any = None  # "none", "required" or {"type": "function", "function": {...}}
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    structural_tag: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = None
    verbosity: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    mm_processor_kwargs: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    REFUSED: ClassVar[Mapping[str, Refused]] = refused.CHAT
    # chat's `logprobs` is a switch; the count SamplingParams calls logprobs is top_logprobs
    PARAM_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    # tool_choice ("none", "required" or a named tool; "auto" is refused) is checked with the
    # fields that constrain the output, in `jaxengine.server.structured`.

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

    def echo_text(self) -> str:
        """What `echo` puts before each reply: the last message's content if it is the
        assistant's (the role of the reply), else nothing (vLLM's rule)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""
