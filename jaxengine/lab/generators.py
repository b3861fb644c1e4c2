"""Workload generators: arrival processes, length mixes, shared prefixes, tenants, scenarios.

Everything is drawn from one `numpy.random.Generator` seeded by the caller, so a scenario with
the same arguments is the same file. Prompt tokens are random ids in `[1, vocab_size)`; a class
with `shared_prefix_len` starts each of its prompts with one of `num_prefixes` fixed prefixes
(a system prompt), which the prefix cache can reuse.

Scenarios (`SCENARIOS`, by name): `many_short`, `long_prompt_short_output`,
`short_prompt_long_output`, `srb_mix` (S: short interactive, priority 0; R: regular,
priority 1; B: batch, priority 2, long prompts and outputs) and `tenants` (two tenants, each
with its own shared system prompt, one sending three times as much as the other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxengine.lab.workloads import Workload, WorkloadError, WorkloadRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestClass:
    """One kind of request in a mix; lengths are drawn uniformly from inclusive ranges."""

    name: str  # the requests' prompt_class label
    weight: float  # share of the requests (normalized over the mix)
    prompt_len: tuple[int, int]  # prompt tokens, shared prefix included
    max_tokens: tuple[int, int]  # output tokens
    priority: int = 0
    tenant: str | None = None
    shared_prefix_len: int = 0  # leading tokens taken from one of the class's shared prefixes
    num_prefixes: int = 1  # distinct shared prefixes of the class

    def __post_init__(self) -> None:
        for name in ("prompt_len", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise WorkloadError(f"class {self.name!r}: {name}={(lo, hi)} must be a range "
                                    "(lo, hi) with 1 <= lo <= hi")
        if self.weight <= 0:
            raise WorkloadError(f"class {self.name!r}: weight must be > 0, got {self.weight}")
        if self.shared_prefix_len >= self.prompt_len[0]:
            raise WorkloadError(f"class {self.name!r}: shared_prefix_len="
                                f"{self.shared_prefix_len} must be below the shortest prompt "
                                f"({self.prompt_len[0]})")


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """`n` arrival times (seconds, the first at 0) of a Poisson process of `rate` per second;
    `rate=inf` puts them all at 0 (an offline batch)."""
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0 requests/s, got {rate}")
    if np.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [round(float(t), 6) for t in np.cumsum(gaps)]


def bursty_arrivals(n: int, rate: float, burst_size: int,
                    rng: np.random.Generator) -> list[float]:
    """`n` arrivals in bursts of `burst_size` at once, the bursts a Poisson process: the mean
    rate is still `rate` requests per second."""
    if burst_size < 1:
        raise WorkloadError(f"burst_size must be >= 1, got {burst_size}")
    bursts = poisson_arrivals(-(-n // burst_size), rate / burst_size, rng)
    return [bursts[i // burst_size] for i in range(n)]


def generate_workload(classes: Sequence[RequestClass], arrivals: Sequence[float], *,
                      rng: np.random.Generator, vocab_size: int,
                      info: dict | None = None) -> Workload:
    """One request per arrival time, its class drawn by weight.

    Args:
      classes: the mix.
      arrivals: arrival times in seconds, one per request (in file order).
      rng: the only source of randomness.
      vocab_size: token ids are drawn from [1, vocab_size).
      info: extra top-level keys for the file (e.g. the scenario's name and arguments).
    """
    if vocab_size < 2:
        raise WorkloadError(f"vocab_size must be >= 2, got {vocab_size}")
    weights = np.array([c.weight for c in classes], dtype=float)
    picks = rng.choice(len(classes), size=len(arrivals), p=weights / weights.sum())
    prefixes = {c.name: [rng.integers(1, vocab_size, c.shared_prefix_len).tolist()
                         for _ in range(c.num_prefixes)] for c in classes}
    requests = []
    for i, (k, t) in enumerate(zip(picks, arrivals, strict=True)):
        c = classes[int(k)]
        length = int(rng.integers(c.prompt_len[0], c.prompt_len[1] + 1))
        prefix = prefixes[c.name][int(rng.integers(c.num_prefixes))] if c.shared_prefix_len else []
        prompt = prefix + rng.integers(1, vocab_size, length - len(prefix)).tolist()
        requests.append(WorkloadRequest(
            request_id=f"{c.name}{i:04d}", prompt_token_ids=tuple(prompt),
            max_tokens=int(rng.integers(c.max_tokens[0], c.max_tokens[1] + 1)),
            arrival_time=float(t), priority=c.priority, tenant=c.tenant, prompt_class=c.name))
    return Workload(requests=tuple(requests), info=dict(info or {}))


def _scaled(r: tuple[int, int], scale: float) -> tuple[int, int]:
    return max(1, round(r[0] * scale)), max(1, round(r[1] * scale))


def _mix(scale: float, *specs: tuple) -> list[RequestClass]:
    """Classes from (name, weight, prompt_len, max_tokens, priority, tenant, prefix_len)."""
    out = []
    for name, weight, prompt, output, priority, tenant, prefix in specs:
        p = _scaled(prompt, scale)
        out.append(RequestClass(name=name, weight=weight, prompt_len=p,
                                max_tokens=_scaled(output, scale), priority=priority,
                                tenant=tenant,
                                shared_prefix_len=min(round(prefix * scale), p[0] - 1)))
    return out


# Lengths at scale 1 suit a 2048-token context (SmolLM2 runs 8192).
_SCENARIO_MIXES: dict[str, Callable[[float], list[RequestClass]]] = {
    "many_short": lambda s: _mix(s, ("short", 1.0, (16, 48), (8, 32), 0, None, 0)),
    "long_prompt_short_output": lambda s: _mix(
        s, ("long", 1.0, (512, 1024), (4, 16), 0, None, 0)),
    "short_prompt_long_output": lambda s: _mix(
        s, ("gen", 1.0, (16, 48), (128, 256), 0, None, 0)),
    "srb_mix": lambda s: _mix(s, ("S", 0.5, (16, 64), (8, 32), 0, None, 0),
                              ("R", 0.35, (128, 384), (32, 96), 1, None, 0),
                              ("B", 0.15, (512, 1024), (64, 192), 2, None, 0)),
    "tenants": lambda s: _mix(s, ("a", 0.75, (160, 320), (16, 64), 0, "a", 128),
                              ("b", 0.25, (160, 320), (16, 64), 0, "b", 128)),
}
SCENARIOS = tuple(_SCENARIO_MIXES)


def scenario(name: str, *, num_requests: int, rate: float, seed: int = 0,
             vocab_size: int = 49152, scale: float = 1.0, burst_size: int = 1) -> Workload:
    """A named scenario's workload.

    Args:
      name: one of `SCENARIOS`.
      num_requests: how many requests.
      rate: mean arrivals per second (inf: all at t=0).
      seed: seeds every draw.
      vocab_size: the model's vocabulary (SmolLM2: 49152).
      scale: multiplies every prompt and output length (e.g. 0.1 for a tiny test model).
      burst_size: > 1 makes arrivals bursty (`bursty_arrivals`), else Poisson.
    Raises:
      WorkloadError: an unknown name or a bad argument.
    """
    if name not in _SCENARIO_MIXES:
        raise WorkloadError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    if num_requests < 1 or scale <= 0:
        raise WorkloadError(f"num_requests must be >= 1 and scale > 0, got {num_requests}, "
                            f"{scale}")
    rng = np.random.default_rng(seed)
    arrivals = (bursty_arrivals(num_requests, rate, burst_size, rng) if burst_size > 1
                else poisson_arrivals(num_requests, rate, rng))
    info = {"name": name, "generator": dict(num_requests=num_requests, rate=str(rate),
                                            seed=seed, vocab_size=vocab_size, scale=scale,
                                            burst_size=burst_size)}
    return generate_workload(_SCENARIO_MIXES[name](scale), arrivals, rng=rng,
                             vocab_size=vocab_size, info=info)
