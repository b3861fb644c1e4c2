"""`SamplingParams`, validated when built, and `SamplingParamsError`, which names the field.

Every rule that needs no model lives here, as vLLM's `SamplingParams._verify_args` does: types,
ranges and the relations between fields. The engine adds the few that need the model or the
engine's build (`jaxengine/sampling/rows.py`: the `max_logprobs` cap, stop token ids below
the vocabulary size, how many stop ids `min_tokens` can hold back, logit_bias and
allowed_token_ids below the vocabulary size, bad_words as tokens) and raises the same error.
"""

import enum
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from types import MappingProxyType
from typing import Any

# vLLM's bounds on a request's seed (torch.long). Negative seeds are valid there, so here too.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# vLLM's OpenAI server clamps each logit_bias value to this range; we clamp here for every caller.
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0


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


class RequestOutputKind(enum.IntEnum):
    """Which outputs of a request the engine's `step()` returns (vLLM's names and values;
    vLLM's `DELTA` is not offered). The scheduler never reads it. An int, so that
    `SamplingParams` crosses JSON wires (multi-host lockstep) as plain data."""

    CUMULATIVE = 0  # one per step that gives the request tokens, each with all its tokens so far
    FINAL_ONLY = 2  # only the finished one (what a batch client reads; no output built per step)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request generation parameters, with vLLM's names and defaults.

    The scheduler reads only the stop-related fields (`max_tokens`, `min_tokens`, `ignore_eos`,
    `stop_token_ids`); the engine uses the rest when sampling and detokenizing.

    Raises:
      SamplingParamsError: a value out of its range or of the wrong type (`param` names it).
    """

    # samples of the prompt; the engine fans them out into requests of n=1 above the scheduler
    # (jaxengine/engine/parallel_sampling.py), which never reads it
    n: int = 1
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
    # top-n logprobs of each prompt token given the ones before it (None: none); such a request
    # does not read the prefix cache (vLLM's skip_reading_prefix_cache), so every position has
    # them
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    skip_special_tokens: bool = True  # leave special tokens out of the output text
    presence_penalty: float = 0.0  # in [-2, 2]: minus this once for a token in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: tokens of the prompt or output, logit / or * it
    # token id -> bias added to its logit, clamped to [-100, 100]; a read-only mapping (None:
    # none). Left out of the hash (a mapping has none); equality still compares it.
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be drawn (None: all)
    bad_words: tuple[str, ...] = ()  # words never generated (tokenized by the engine)
    # The grammar the output must match: a `jaxengine.structured.StructuredOutputsParams`
    # (validated when built; typed loosely because the scheduler never imports jaxengine, and
    # checked by the engine). None: unconstrained.
    structured_outputs: Any = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # the outputs step() returns
    # vLLM's free-form arguments for plugins, a read-only mapping of str keys (None: none):
    # the engine reads "kv_transfer_params" (prefill/decode disaggregation, docs/DESIGN.md).
    extra_args: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        # Lists (or None) are accepted for convenience; tuples keep the object hashable and pure.
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids",
                                                              self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop)
        object.__setattr__(self, "stop", stop)
        _check_lengths(self)
        _check_sampling(self)
        _check_stops(self)
        _check_penalties(self)
        _check_output_kind(self)
        _check_structured_outputs(self)
        _normalize_logits_fields(self)
        _freeze_extra_args(self)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        """Picklable and copyable although the read-only `logit_bias` and `extra_args`
        mappings are not: rebuilt (and validated again) from its fields."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("logit_bias", "extra_args"):
            if kw[name] is not None:
                kw[name] = dict(kw[name])
        return functools.partial(SamplingParams, **kw), ()


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
    if not _is_int(sp.n) or sp.n < 1:
        raise _fail("n", sp.n, f"n (samples per prompt) must be an integer >= 1, got {sp.n!r}")
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
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(sp, name)
        if v is not None and (not _is_int(v) or v < 0):
            raise _fail(name, v, f"{name} must be an integer >= 0 or None, got {v!r}")


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


def _check_structured_outputs(sp: SamplingParams) -> None:
    """A mapping is the likeliest mistake (the server's JSON field is one): say how to wrap it.
    Other types are the engine's to refuse (`jaxengine/engine/inputs.py`), as this package
    cannot name the class."""
    so = sp.structured_outputs
    if isinstance(so, Mapping):
        raise _fail("structured_outputs", so,
                    f"structured_outputs must be a StructuredOutputsParams, got a "
                    f"{type(so).__name__}; wrap it: StructuredOutputsParams(**{dict(so)!r}) "
                    f"(from jaxengine import StructuredOutputsParams)")


def _check_output_kind(sp: SamplingParams) -> None:
    """The kind, or its value (as JSON carries it), becomes a `RequestOutputKind`."""
    try:
        kind = RequestOutputKind(sp.output_kind) if _is_int(sp.output_kind) else None
    except ValueError:
        kind = None
    if kind is None:
        raise _fail("output_kind", sp.output_kind,
                    f"output_kind must be a RequestOutputKind (CUMULATIVE or FINAL_ONLY), got "
                    f"{sp.output_kind!r}")
    object.__setattr__(sp, "output_kind", kind)


def _check_penalties(sp: SamplingParams) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not _is_real(v) or not -2 <= v <= 2:
            raise _fail(name, v, f"{name} must be a number in [-2, 2] (0: off), got {v!r}")
    v = sp.repetition_penalty
    if not _is_real(v) or not v > 0:
        raise _fail("repetition_penalty", v,
                    f"repetition_penalty must be a finite number > 0 (1: off), got {v!r}")


def _normalize_logits_fields(sp: SamplingParams) -> None:
    """logit_bias becomes a read-only, clamped {int: float}; allowed_token_ids and bad_words
    tuples (vLLM's checks; the engine checks ids against the vocabulary)."""
    if sp.logit_bias is not None:
        if not isinstance(sp.logit_bias, Mapping):
            raise _fail("logit_bias", sp.logit_bias,
                        f"logit_bias must be a dict of token id -> bias, got {sp.logit_bias!r}")
        bias = {}
        for t, b in sp.logit_bias.items():
            if not _is_int(t) or t < 0:
                raise _fail("logit_bias", t, f"logit_bias keys must be token ids (integers "
                                             f">= 0; convert JSON's string keys), got {t!r}")
            if not _is_real(b):
                raise _fail("logit_bias", b,
                            f"logit_bias values must be finite numbers, got {b!r} for {t}")
            bias[int(t)] = min(LOGIT_BIAS_MAX, max(LOGIT_BIAS_MIN, float(b)))
        object.__setattr__(sp, "logit_bias", MappingProxyType(bias))
    if sp.allowed_token_ids is not None:
        ids = _as_tuple("allowed_token_ids", sp.allowed_token_ids)
        if not ids:
            raise _fail("allowed_token_ids", ids, "allowed_token_ids must not be empty (None: "
                                                  "every token allowed)")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise _fail("allowed_token_ids", t, f"allowed_token_ids must be token ids "
                                                    f"(integers >= 0), got {t!r}")
        object.__setattr__(sp, "allowed_token_ids", tuple(int(t) for t in ids))
    words = (sp.bad_words,) if isinstance(sp.bad_words, str) else _as_tuple("bad_words",
                                                                              sp.bad_words)
    if any(not isinstance(w, str) or not w.strip() for w in words):
        raise _fail("bad_words", words,
                    f"bad_words must be non-blank strings, got {list(words)!r}")
    object.__setattr__(sp, "bad_words", words)


def _freeze_extra_args(sp: SamplingParams) -> None:
    """extra_args becomes a read-only {str: value} (its values are the caller's)."""
    if sp.extra_args is None:
        return
    if not isinstance(sp.extra_args, Mapping) or not all(isinstance(k, str)
                                                         for k in sp.extra_args):
        raise _fail("extra_args", sp.extra_args,
                    f"extra_args must be a dict with string keys, got {sp.extra_args!r}")
    object.__setattr__(sp, "extra_args", MappingProxyType(dict(sp.extra_args)))
