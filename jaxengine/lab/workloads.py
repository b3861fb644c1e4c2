"""The workload file: requests with prompts, output lengths and arrival times.

    {"requests": [{"prompt_token_ids": [1, 2, 3], "max_tokens": 16,
                   "arrival_time": 0.5, "priority": 0, "tenant": "a"}, ...]}

`prompt_token_ids` and `max_tokens` are required; `arrival_time` (seconds after the start of
the run, default 0), `priority` (lower runs first under the priority policy, default 0),
`tenant`, `id` (default `r<index>`) and `prompt_class` (a label) are optional.
Every request generates exactly `max_tokens` tokens (greedy, EOS ignored), so a simulated run
and a real one do the same work. Other top-level keys (a name, a description) are kept.
`benchmarks/workloads/mix64.json` is one (all requests at t=0).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_OPTIONAL = ("id", "arrival_time", "priority", "tenant", "prompt_class")
_REQUIRED = ("prompt_token_ids", "max_tokens")


class WorkloadError(ValueError):
    """A workload file or value that is not valid; the message names the request and field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadRequest:
    """One request of a workload."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # exactly this many output tokens (EOS is ignored)
    arrival_time: float = 0.0  # seconds after the run starts
    priority: int = 0  # lower runs first under scheduling_policy="priority"
    tenant: str | None = None  # who sent it (for per-tenant summaries and policies)
    prompt_class: str | None = None  # a label, e.g. "S", "R", "B"

    def to_json(self) -> dict[str, Any]:
        """The request as a workload-file object (optional fields only when set)."""
        out: dict[str, Any] = {"id": self.request_id,
                               "prompt_token_ids": list(self.prompt_token_ids),
                               "max_tokens": self.max_tokens}
        if self.arrival_time:
            out["arrival_time"] = self.arrival_time
        if self.priority:
            out["priority"] = self.priority
        for name in ("tenant", "prompt_class"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Requests in file order (the order results are reported in), plus descriptive keys."""

    requests: tuple[WorkloadRequest, ...]
    info: Mapping[str, Any] = field(default_factory=dict)  # other top-level keys, kept as-is

    def __post_init__(self) -> None:
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise WorkloadError(f"request id {dup!r} appears more than once; ids must be unique")
        if not self.requests:
            raise WorkloadError("the workload has no requests")

    @property
    def by_arrival(self) -> list[WorkloadRequest]:
        """Requests ordered by arrival time (file order among equal times)."""
        return sorted(self.requests, key=lambda r: r.arrival_time)

    @property
    def last_arrival(self) -> float:
        """The latest arrival time."""
        return max(r.arrival_time for r in self.requests)

    def to_json(self) -> dict[str, Any]:
        """The workload as a JSON-able object."""
        return {**self.info, "requests": [r.to_json() for r in self.requests]}


def parse_workload(data: Any) -> Workload:
    """A `Workload` from a decoded JSON value (an object with "requests", or a bare list).

    Raises:
      WorkloadError: the message names the request (index and id) and the field to fix.
    """
    if isinstance(data, list):
        data = {"requests": data}
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise WorkloadError('a workload is a JSON object {"requests": [...]} (or a list of '
                            f"requests); got {type(data).__name__}"
                            + (" without a 'requests' list" if isinstance(data, dict) else ""))
    info = {k: v for k, v in data.items() if k != "requests"}
    return Workload(requests=tuple(_request(i, r) for i, r in enumerate(data["requests"])),
                    info=info)


def _request(index: int, r: Any) -> WorkloadRequest:
    where = f"requests[{index}]"
    if not isinstance(r, dict):
        raise WorkloadError(f"{where} must be an object, got {type(r).__name__}")
    if isinstance(r.get("id"), str):
        where += f" (id {r['id']!r})"
    unknown = sorted(set(r) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise WorkloadError(f"{where} has unknown field(s) {unknown}; known: "
                            f"{list(_REQUIRED + _OPTIONAL)}")
    for name in _REQUIRED:
        if name not in r:
            raise WorkloadError(f"{where} lacks {name!r}")
    ids = r["prompt_token_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise WorkloadError(f"{where}.prompt_token_ids must be a non-empty list of token ids "
                            "(integers >= 0)")
    _check_int(where, "max_tokens", r["max_tokens"], minimum=1)
    arrival = r.get("arrival_time", 0.0)
    if (not isinstance(arrival, int | float) or isinstance(arrival, bool)
            or not math.isfinite(arrival) or arrival < 0):
        raise WorkloadError(f"{where}.arrival_time must be a number of seconds >= 0, "
                            f"got {arrival!r}")
    priority = r.get("priority", 0)
    _check_int(where, "priority", priority, minimum=None)
    for name in ("id", "tenant", "prompt_class"):
        if name in r and not isinstance(r[name], str):
            raise WorkloadError(f"{where}.{name} must be a string, got {r[name]!r}")
    return WorkloadRequest(
        request_id=r.get("id", f"r{index}"), prompt_token_ids=tuple(ids),
        max_tokens=r["max_tokens"], arrival_time=float(arrival), priority=priority,
        tenant=r.get("tenant"), prompt_class=r.get("prompt_class"))


def _check_int(where: str, name: str, value: Any, *, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (
            minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise WorkloadError(f"{where}.{name} must be an integer{bound}, got {value!r}")


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file.

    Raises:
      WorkloadError: the file is missing, not JSON, or not a valid workload.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise WorkloadError(f"workload file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise WorkloadError(f"workload file {str(path)!r} is not valid JSON: {e}") from None
    try:
        return parse_workload(data)
    except WorkloadError as e:
        raise WorkloadError(f"{path}: {e}") from None


def save_workload(workload: Workload, path: str | Path) -> None:
    """Write `workload` as JSON (one request per line, so diffs stay readable)."""
    obj = workload.to_json()
    head = {k: v for k, v in obj.items() if k != "requests"}
    lines = ",\n".join("  " + json.dumps(r) for r in obj["requests"])
    prefix = json.dumps(head)[1:-1]
    with open(path, "w") as f:
        f.write("{" + (prefix + ", " if prefix else "") + '"requests": [\n' + lines + "\n]}\n")
