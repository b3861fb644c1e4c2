"""What one request may ask of the server, checked before any work is done for it.

A request's cost grows with what it asks for: n samples of each prompt become n engine
requests, a prompt's characters are tokenized, a chat is rendered through a Jinja template.
These bounds are checked on the event loop, by the lengths of what the request holds, before
any of that work starts (the work itself then runs in a worker thread: `OpenAIServing`), so one
request can neither grow the process without bound nor hold the event loop for long. (What is
left on the loop: parsing the body, and adding the choices to the engine under its lock, about
70 us each.)

- `n` is at most the engine's `max_num_seqs` (more samples of one prompt than it runs at once
  would only queue behind each other; vLLM's own cap is VLLM_MAX_N_SEQUENCES, 16384, which
  here would hold a server for seconds), and a request's choices (prompts x n, one engine
  request each) at most `MAX_CHOICES`.
- A text prompt (a chat's messages, then the prompt they render to) has at most
  `max_model_len * Tokenizer.max_chars_per_token()` characters: a longer one has more tokens
  than the context holds, whatever they are. `truncate_prompt_tokens` does not lift this
  bound: the text is tokenized whole before its last tokens are kept. A token-id prompt has at
  most `max_model_len` ids unless the request truncates it (the ids are already parsed, and
  cost nothing more to cut). The exact check, on the token count, follows tokenization
  (`resolve_max_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxengine.loading.tokenizer import Tokenizer
from jaxengine.server.protocol import RequestError, prompt_too_long

# vLLM's bound on a completions request's prompts (the default of VLLM_MAX_COMPLETION_PROMPTS),
# here on its choices: prompts x n engine requests.
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLimits:
    """The bounds of one server's requests (`of` derives them from its engine)."""

    max_model_len: int  # tokens of prompt and output together
    max_n: int  # samples per prompt: the engine's max_num_seqs
    max_choices: int = MAX_CHOICES  # engine requests one request makes (prompts x n)
    # characters of prompt text: max_model_len tokens of the most characters one token can
    # stand for (None: no tokenizer, so no text prompts)
    max_prompt_chars: int | None

    @classmethod
    def of(cls, *, max_model_len: int, max_num_seqs: int,
           tokenizer: Tokenizer | None) -> RequestLimits:
        """The limits of an engine with this context, sequence limit and tokenizer."""
        chars = None if tokenizer is None else max_model_len * tokenizer.max_chars_per_token()
        return cls(max_model_len=max_model_len, max_n=max_num_seqs, max_prompt_chars=chars)

    def check_choices(self, n: int, num_prompts: int) -> None:
        """Refuse more than `max_n` samples per prompt, or more than `max_choices` in all.

        Raises:
          RequestError: naming `n`, or `prompt` (vLLM's name for a too long prompt list).
        """
        if n > self.max_n:
            raise RequestError(f"n must be at most {self.max_n}, got {n}: this server runs at "
                               f"most {self.max_n} sequences at once (its max_num_seqs)", "n")
        if n * num_prompts > self.max_choices:
            raise RequestError(f"the request asks for {num_prompts} prompts x n={n} = "
                               f"{n * num_prompts} choices; a request may ask for at most "
                               f"{self.max_choices}: split it into several requests", "prompt")

    def check_text(self, chars: int, param: str) -> None:
        """Refuse prompt text of more characters than `max_model_len` tokens can hold.

        Args:
          chars: the text's length in characters (code points).
          param: the request's field that holds it.
        Raises:
          RequestError: the text is too long, naming `param` and the bound.
        """
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise RequestError(
                f"the prompt has {chars} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold whatever the tokens are (at "
                f"most {self.max_prompt_chars} characters); shorten it", param)

    def check_prompts(self, prompts: Sequence[str | list[int]], *, truncated: bool) -> None:
        """Refuse a completions prompt that cannot fit: text longer than `check_text` allows,
        or more token ids than `max_model_len` unless the request truncates them.

        Raises:
          RequestError: naming `prompt`.
        """
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_text(len(prompt), "prompt")
            elif len(prompt) > self.max_model_len and not truncated:
                raise prompt_too_long(len(prompt), self.max_model_len, "prompt")
