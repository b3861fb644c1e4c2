"""Request bodies to engine prompts: completions' text or token-id prompts, a rendered chat.

An engine prompt is `{"prompt": text, "prompt_token_ids": ids}` (`LLMEngine.add_request`'s
form; no `"prompt"` for token ids). vLLM's `truncate_prompt_tokens=k` keeps the last k tokens;
the prompt text is then the decoding of what is kept (what `echo` shows).
"""

from __future__ import annotations

from typing import Any

from jaxengine.engine.inputs import resolve_prompt
from jaxengine.server.chat_protocol import ChatTemplateFields
from jaxengine.server.limits import RequestLimits
from jaxengine.server.protocol import CompletionRequest, RequestError

EnginePrompt = dict[str, Any]


def completion_prompts(body: CompletionRequest, tokenizer: Any, vocab_size: int
                       ) -> list[EnginePrompt]:
    """Each prompt of a completions request, tokenized (`add_special_tokens` as the body says).

    Raises:
      RequestError: an empty prompt, text without a tokenizer, or token ids outside the
        vocabulary (naming `prompt`; checked before they are cut or decoded for `echo`).
    """
    prompts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            ids = _encode(tokenizer, prompt, add_special_tokens=body.add_special_tokens)
            engine_prompt: EnginePrompt = {"prompt": prompt, "prompt_token_ids": ids}
        else:
            try:
                _, ids = resolve_prompt({"prompt_token_ids": list(prompt)}, None, vocab_size)
            except ValueError as e:
                raise RequestError(str(e), "prompt") from None
            engine_prompt = {"prompt_token_ids": ids}
        prompts.append(truncated(engine_prompt, body.truncate_prompt_tokens, tokenizer))
    return prompts


def chat_prompt(body: ChatTemplateFields, tokenizer: Any, limits: RequestLimits
                ) -> EnginePrompt:
    """The conversation rendered by the chat template (the body's own, if it sends one).

    Raises:
      RequestError: no tokenizer, a conversation that renders to nothing or to more text than
        `limits` allow (before it is tokenized), or a template that fails on it (the message
        is the template's).
    """
    if tokenizer is None:
        raise RequestError("this server has no tokenizer: chat is unavailable")
    messages = [m.as_template_message() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=body.generation_prompt(),
                                             **body.template_kwargs())
    except RequestError:
        raise
    except Exception as e:  # jinja's errors (a bad request template, raise_exception())
        raise RequestError(f"the chat template failed on this conversation: {e}",
                           "messages") from None
    limits.check_text(len(text), "messages")
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    if not ids:
        raise RequestError("the conversation renders to an empty prompt", "messages")
    return {"prompt": text, "prompt_token_ids": ids}


def truncated(prompt: EnginePrompt, keep: int | None, tokenizer: Any) -> EnginePrompt:
    """`prompt` with only its last `keep` tokens (None: all)."""
    ids = prompt["prompt_token_ids"]
    if keep is None or len(ids) <= keep:
        return prompt
    ids = ids[-keep:]
    if tokenizer is None:
        return {"prompt_token_ids": ids}
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False), "prompt_token_ids": ids}


def prompt_text(prompt: EnginePrompt, tokenizer: Any, *, skip_special_tokens: bool) -> str:
    """The prompt as text, for `echo`: as sent, else its ids decoded."""
    if "prompt" in prompt:
        return prompt["prompt"]
    if tokenizer is None:
        raise RequestError("echo of a token-id prompt needs a tokenizer, and this server has "
                           "none", "echo")
    return tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=skip_special_tokens)


def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    if tokenizer is None:
        raise RequestError("this server has no tokenizer: send token ids as the prompt",
                           "prompt")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    return ids
