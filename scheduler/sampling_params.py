"""`SamplingParams`, validated when built, and `SamplingParamsError`, which names the field.

Every rule that needs no model lives here, as vLLM's `SamplingParams._verify_args` does: types,
ranges and the relations between fields. The engine adds the few that need the model or the
engine's build (`jaxengine/sampling/metadata.py`: the `max_logprobs` cap, stop token ids below
the vocabulary size, how many stop ids `min_tokens` can hold back) and raises the same error.
"""

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

# vLLM's bounds on a request's seed (torch.long). Negative seeds are valid there, so here too.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter that cannot be used; the message says what to change.

    The field is kept as data, so a caller (the HTTP server) can name it without parsing the
    message.

    Attributes:
      param: the `SamplingParams` field, e.g. `"top_p"`.
      value: the offending value.
    """

    def __init__(self, message: str, *, param: str, value: Any = None) -> None:
        super().__init__(message)
        self.param = param
        self.value = value


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request generation parameters, with vLLM's names and defaults.

    The scheduler reads only the stop-related fields (`max_tokens`, `min_tokens`, `ignore_eos`,
    `stop_token_ids`); the engine uses the rest when sampling and detokenizing.

    Raises:
      SamplingParamsError: a value out of its range or of the wrong type (`param` names it).
    """

    max_tokens: int | None = 16  # most output tokens; None: up to max_model_len
    min_tokens: int = 0  # EOS and stop token ids are ignored before this many outputs
    ignore_eos: bool = False  # keep generating past EOS
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that stop the request
    stop: tuple[str, ...] = ()  # stop strings (applied by the engine's detokenizer)
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # nucleus mass in (0, 1]
    min_p: float = 0.0  # drop tokens below min_p * p(max)
    seed: int | None = None  # per-request seed: same seed, same tokens
    logprobs: int | None = None  # top-n logprobs per output token (None: none)
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    skip_special_tokens: bool = True  # leave special tokens out of the output text

    def __post_init__(self) -> None:
        # Lists (or None) are accepted for convenience; tuples keep the object hashable and pure.
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids",
                                                              self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop)
        object.__setattr__(self, "stop", stop)
        _check_lengths(self)
        _check_sampling(self)
        _check_stops(self)


def _fail(param: str, value: Any, message: str) -> SamplingParamsError:
    return SamplingParamsError(message, param=param, value=value)


def _as_tuple(param: str, value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    try:
        return tuple(value)
    except TypeError:
        raise _fail(param, value, f"{param} must be a list, got {value!r}") from None


def _is_int(x: Any) -> bool:
    """An int (numpy's included), not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    """A finite int or float (numpy's included): not a bool, a string, inf or NaN."""
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _check_lengths(sp: SamplingParams) -> None:
    if sp.max_tokens is not None and (not _is_int(sp.max_tokens) or sp.max_tokens <= 0):
        raise _fail("max_tokens", sp.max_tokens,
                    f"max_tokens must be a positive integer or None, got {sp.max_tokens!r}")
    if not _is_int(sp.min_tokens) or sp.min_tokens < 0 or (
        sp.max_tokens is not None and sp.min_tokens > sp.max_tokens
    ):
        raise _fail("min_tokens", sp.min_tokens,
                    f"min_tokens must be in [0, max_tokens={sp.max_tokens}], got "
                    f"{sp.min_tokens!r}")


def _check_sampling(sp: SamplingParams) -> None:
    # inf and NaN are refused: a NaN fails every comparison below, inf needs isfinite.
    if not _is_real(sp.temperature) or not sp.temperature >= 0:
        raise _fail("temperature", sp.temperature, f"temperature must be a finite number >= 0 "
                                                   f"(0 = greedy), got {sp.temperature!r}")
    if not _is_real(sp.top_p) or not 0 < sp.top_p <= 1:
        raise _fail("top_p", sp.top_p, f"top_p must be in (0, 1], got {sp.top_p!r}")
    if not _is_real(sp.min_p) or not 0 <= sp.min_p <= 1:
        raise _fail("min_p", sp.min_p, f"min_p must be in [0, 1], got {sp.min_p!r}")
    if not _is_int(sp.top_k) or sp.top_k < -1:
        raise _fail("top_k", sp.top_k,
                    f"top_k must be -1 or 0 (off) or a positive integer, got {sp.top_k!r}")
    if sp.seed is not None and not (_is_int(sp.seed) and SEED_MIN <= sp.seed <= SEED_MAX):
        raise _fail("seed", sp.seed, f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] "
                                     f"(int64, as vLLM), or None; got {sp.seed!r}")
    if sp.logprobs is not None and (not _is_int(sp.logprobs) or sp.logprobs < 0):
        raise _fail("logprobs", sp.logprobs,
                    f"logprobs must be an integer >= 0 or None, got {sp.logprobs!r}")


def _check_stops(sp: SamplingParams) -> None:
    if any(not isinstance(s, str) or not s for s in sp.stop):
        raise _fail("stop", sp.stop, f"stop must be non-empty strings, got {list(sp.stop)!r}")
    for t in sp.stop_token_ids:
        if not _is_int(t) or t < 0:
            raise _fail("stop_token_ids", t,
                        f"stop_token_ids must be token ids (integers >= 0), got {t!r}")
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(getattr(sp, name), bool):
            raise _fail(name, getattr(sp, name),
                        f"{name} must be True or False, got {getattr(sp, name)!r}")
