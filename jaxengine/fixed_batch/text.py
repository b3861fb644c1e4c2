"""Strings in, fixed-batch arrays out, and back: the host side of `generate` and `score`.

`encode_batch` tokenizes prompts as `LLM.generate` and `LLM.chat` do (plain text with the
tokenizer's special-token rule, conversations through the chat template) and left-pads them
into `(prompt_ids i32[B, S], prompt_lens i32[B])` (or right-pads the continuations `score`
takes); `decode_batch` turns a `GenerateOutput`
back into each row's text, stopping at its length and leaving out the EOS, as the engine's
`CompletionOutput.text` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxengine.fixed_batch.generate import GenerateOutput
from jaxengine.llm import chat_prompt

# One prompt: text, token ids, or a conversation ([{"role": ..., "content": ...}, ...]).
BatchPrompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


def encode_batch(tokenizer: Any, prompts: BatchPrompt | Sequence[BatchPrompt], *,
                 width: int | None = None, pad_id: int = 0, padding_side: str = "left",
                 add_special_tokens: bool = True, add_generation_prompt: bool = True,
                 chat_template_kwargs: Mapping[str, Any] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize and pad a batch of prompts (or continuations) for `generate` / `score`.

    Args:
      tokenizer: the model's tokenizer (`load_model_fns(path)[1]`, `llm.get_tokenizer()`).
      prompts: one prompt or a list; each a string, a list of token ids, or a conversation
        (rendered with the chat template, as `LLM.chat` renders it).
      width: S, the padded width (default: the longest prompt). A fixed width keeps one
        compiled program for batches of different lengths (S is static).
      pad_id: the id the padding holds (it is never attended to).
      padding_side: "left" for prompts (right-aligned rows), "right" for the continuations
        of `score` (transformers' name).
      add_special_tokens: the tokenizer's bos/eos rule for text (False for continuations).
      add_generation_prompt, chat_template_kwargs: for conversations, as in `LLM.chat`.
    Returns:
      (ids i32[B, S], lens i32[B]), numpy arrays.
    Raises:
      ValueError: an empty batch or prompt, a prompt longer than `width`, a prompt of
        another type, or an unknown `padding_side`.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    ids = [_ids(tokenizer, p, add_special_tokens, add_generation_prompt, chat_template_kwargs)
           for p in _as_batch(prompts)]
    if not ids:
        raise ValueError("encode_batch got no prompts; pass at least one")
    for b, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {b} has no tokens; every row needs at least one")
    longest = max(map(len, ids))
    S = longest if width is None else width
    if longest > S:
        raise ValueError(f"a prompt has {longest} tokens, more than width={width}; raise "
                         f"width or shorten the prompt")
    out = np.full((len(ids), S), pad_id, np.int32)
    for b, row in enumerate(ids):
        if padding_side == "left":
            out[b, S - len(row):] = row
        else:
            out[b, :len(row)] = row
    return out, np.asarray([len(r) for r in ids], np.int32)


def decode_batch(tokenizer: Any, output: GenerateOutput, *, skip_special_tokens: bool = True
                 ) -> list[str]:
    """The text of each row of a `generate` result.

    Args:
      tokenizer: the model's tokenizer.
      output: `generate`'s result (device or numpy arrays).
      skip_special_tokens: leave special tokens out of the text (vLLM's default).
    Returns:
      One string per row: its first `lengths[b]` tokens, a final EOS
      (`tokenizer.eos_token_ids`) left out.
    """
    eos = set(getattr(tokenizer, "eos_token_ids", ()))
    tokens, lengths = np.asarray(output.tokens), np.asarray(output.lengths)
    texts = []
    for row, n in zip(tokens.tolist(), lengths.tolist(), strict=True):
        row = row[:n]
        if row and row[-1] in eos:
            row = row[:-1]
        texts.append(tokenizer.decode(row, skip_special_tokens=skip_special_tokens))
    return texts


def _as_batch(prompts: BatchPrompt | Sequence[BatchPrompt]) -> list[BatchPrompt]:
    """A list of prompts: one string, one conversation or one id list is a batch of one."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, Mapping) for p in prompts):
        return [prompts]  # one conversation
    if prompts and all(_is_int(p) for p in prompts):
        return [prompts]  # one list of ids
    return prompts


def _ids(tokenizer: Any, prompt: BatchPrompt, add_special_tokens: bool,
         add_generation_prompt: bool, chat_template_kwargs: Mapping[str, Any] | None
         ) -> list[int]:
    if isinstance(prompt, str):  # by default what the engine does with a text prompt
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if isinstance(prompt, Sequence) and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        return chat_prompt(tokenizer, prompt, add_generation_prompt=add_generation_prompt,
                           chat_template_kwargs=chat_template_kwargs)["prompt_token_ids"]
    raise ValueError(f"a prompt must be a string, a list of token ids or a conversation "
                     f"([{{'role': ..., 'content': ...}}, ...]), got {prompt!r:.80}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)
