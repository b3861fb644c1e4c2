"""What one request may ask of the server, checked before any work is done for it.

A request's cost grows with what it asks for: n samples of each prompt become n engine
requests, each with its own state in the scheduler and its own output stream. These bounds are
checked before any of that work starts, so one request can neither grow the process without
bound nor hold the event loop:

- `n` is at most the engine's `max_num_seqs` (more samples of one prompt than it runs at once
  would only queue behind each other; vLLM's own cap is VLLM_MAX_N_SEQUENCES, 16384, which
  here would hold a server for seconds), and a request's choices (prompts x n, one engine
  request each) at most `MAX_CHOICES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxengine.server.protocol import RequestError

# vLLM's bound on a completions request's prompts (the default of VLLM_MAX_COMPLETION_PROMPTS),
# here on its choices: prompts x n engine requests.
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLimits:
    """The bounds of one server's requests."""

    max_n: int  # samples per prompt: the engine's max_num_seqs
    max_choices: int = MAX_CHOICES  # engine requests one request makes (prompts x n)

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
