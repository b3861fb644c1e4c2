"""`SpeculativeConfig`: vLLM's `speculative_config` dict, parsed and validated.

The engine argument is the dict a user writes (`LLM(speculative_config={...})`,
`jaxengine serve --speculative-config '{json}'`); `SpeculativeConfig.from_dict` turns it into a
frozen config or raises a `ValueError` naming the key and what to change. vLLM's defaults:
`prompt_lookup_min` / `prompt_lookup_max` take each other's value when only one is given, and 5
when neither is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")  # built; vLLM's EAGLE family and MTP are not yet
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's value when neither bound is given
_KEYS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
         "draft_model": ("method", "model", "num_speculative_tokens")}
_NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's names), validated when built."""

    method: str  # "ngram": prompt lookup (spec/ngram.py); "draft_model": spec/draft_model.py
    num_speculative_tokens: int  # k, the most draft tokens a request gets per step
    model: str | None = None  # draft_model: the draft's HF directory or .gguf file
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # shortest suffix n-gram that may match
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # longest suffix n-gram tried first

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}; "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got "
                                 f"{value!r}")
        if (self.method == "draft_model") != isinstance(self.model, str):
            raise ValueError(f"speculative_config: model (the draft's HF directory or .gguf "
                             f"file) is required by method 'draft_model' and taken by no other; "
                             f"got {self.model!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} "
                             f"must be <= prompt_lookup_max={self.prompt_lookup_max}")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV positions the drafter writes past a step's tokens (vLLM's name): a draft model's
        k proposal steps; n-gram drafts write none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> SpeculativeConfig:
        """Parse vLLM's `speculative_config` dict.

        Args:
          config: e.g. `{"method": "ngram", "num_speculative_tokens": 3,
            "prompt_lookup_min": 2, "prompt_lookup_max": 4}`.
        Raises:
          ValueError: not a dict, a missing or unknown method, a key the method does not take,
            or a bad value; the message names it.
        """
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}}, got {type(config).__name__}")
        method = config.get("method")
        if method in _NOT_BUILT:
            raise ValueError(f"speculative_config: method {method!r} is not built yet; use "
                             f"'ngram' or 'draft_model'")
        if method not in _KEYS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}; "
                             f"got {method!r}")
        unknown = sorted(set(config) - set(_KEYS[method]))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}"
                             f" for method {method!r}; it takes {', '.join(_KEYS[method])}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required (the draft "
                             "tokens per step, e.g. 3)")
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        return cls(method=method, num_speculative_tokens=config["num_speculative_tokens"],
                   prompt_lookup_min=lo, prompt_lookup_max=hi, model=config.get("model"))
