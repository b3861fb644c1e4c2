"""One result format for simulated and real runs of a workload, and its summary.

    {"duration": 12.3, "requests": [{"id": "r0", "ttft": 0.41, "tpot": 0.05, "e2e": 1.9,
                                     "queue": 0.02, ...}, ...], "steps": [...], "info": {...}}

Requests are in workload order; every time is in seconds, measured from the request's own
arrival (`ttft`, `e2e`, `queue`: arrival to first scheduling) or between its tokens (`tpot`,
over the tokens after the first; None with fewer than two), as `RequestMetrics` defines them.
`duration` runs from the start of the run (t=0 of the workload's arrival times) to the last
finish. `steps` holds one record per engine step where the producer keeps them (the
simulator does); `info` says what produced it (kind "simulated" or "real", engine arguments).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jaxengine.engine.outputs import RequestMetrics
from jaxengine.lab.workloads import WorkloadRequest

METRICS = ("ttft", "tpot", "e2e", "queue")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestResult:
    """How one request fared; times in seconds (see the module docstring)."""

    id: str
    arrival_time: float  # after the run's start
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache supplied at first scheduling
    ttft: float | None  # arrival -> first token
    tpot: float | None  # mean time between output tokens after the first
    e2e: float | None  # arrival -> finish
    queue: float | None  # arrival -> first scheduled
    priority: int = 0
    tenant: str | None = None
    prompt_class: str | None = None


def request_result(request: WorkloadRequest, metrics: RequestMetrics, *,
                   num_cached_tokens: int) -> RequestResult:
    """The result of `request` from its engine metrics, times in the run's own clock."""
    return RequestResult(
        id=request.request_id, arrival_time=request.arrival_time,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=metrics.num_generation_tokens, num_cached_tokens=num_cached_tokens,
        ttft=metrics.ttft, tpot=metrics.tpot, e2e=metrics.e2e_latency,
        queue=metrics.time_in_queue, priority=request.priority, tenant=request.tenant,
        prompt_class=request.prompt_class)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """A run of a workload, simulated or real."""

    duration: float  # seconds from t=0 to the last finish
    requests: tuple[RequestResult, ...]  # in workload order
    steps: tuple[Mapping[str, Any], ...] = ()  # one record per engine step, if kept
    info: Mapping[str, Any] = field(default_factory=dict)  # kind, engine args, ...

    def to_json(self) -> dict[str, Any]:
        """A JSON-able object (the file format)."""
        return {"duration": self.duration, "requests": [asdict(r) for r in self.requests],
                "steps": [dict(s) for s in self.steps], "info": dict(self.info)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunResult:
        """Read the file format back."""
        try:
            return cls(duration=float(data["duration"]),
                       requests=tuple(RequestResult(**r) for r in data["requests"]),
                       steps=tuple(data.get("steps", ())), info=dict(data.get("info", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a result file (duration, requests[...]): {e}") from None


def save_result(result: RunResult, path: str | Path) -> None:
    """Write `result` as JSON."""
    with open(path, "w") as f:
        json.dump(result.to_json(), f)
        f.write("\n")


def load_result(path: str | Path) -> RunResult:
    """Read a result file written by `save_result`."""
    with open(path) as f:
        return RunResult.from_json(json.load(f))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; NaN if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summary(result: RunResult) -> dict[str, float]:
    """Throughput and latency percentiles: `duration`, `output_tokens_per_s`,
    `requests_per_s`, and `<metric>_p<q>` / `<metric>_mean` for ttft, tpot, e2e, queue."""
    out = {"duration": result.duration,
           "output_tokens_per_s": sum(r.num_output_tokens for r in result.requests)
           / max(result.duration, 1e-12),
           "requests_per_s": len(result.requests) / max(result.duration, 1e-12)}
    for m in METRICS:
        values = [getattr(r, m) for r in result.requests if getattr(r, m) is not None]
        for q in PERCENTILES:
            out[f"{m}_p{q}"] = percentile(values, q)
        out[f"{m}_mean"] = sum(values) / len(values) if values else float("nan")
    return out


def format_summary(result: RunResult, label: str = "") -> str:
    """`summary` as a few human-readable lines (seconds, and tokens/s)."""
    s = summary(result)
    head = (f"{label + ': ' if label else ''}{len(result.requests)} requests in "
            f"{s['duration']:.3f} s, {s['output_tokens_per_s']:.1f} output tokens/s")
    rows = [f"  {m:5s} " + "  ".join(f"p{q} {s[f'{m}_p{q}']:.4f}" for q in PERCENTILES)
            + f"  mean {s[f'{m}_mean']:.4f}" for m in METRICS]
    return "\n".join([head, *rows])


def compare(simulated: RunResult, real: RunResult) -> dict[str, float]:
    """Relative error (simulated / real - 1) of duration, p50 TTFT and p50 e2e."""
    a, b = summary(simulated), summary(real)
    return {k: a[k] / b[k] - 1.0 for k in ("duration", "ttft_p50", "e2e_p50", "tpot_p50")
            if b[k] and not math.isnan(b[k])}
