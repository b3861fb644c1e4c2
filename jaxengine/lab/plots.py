"""Pictures of the lab's runs: a per-step timeline, latency CDFs, the tuner's Pareto front.

Each function takes plain data (the dataclasses below, `StepRecord`, or dicts with the same
keys), returns a `matplotlib.figure.Figure`, and writes it as a PNG when given `save=path`.
Figures are built without pyplot: no display, no backend choice and no global figure list are
involved (saving renders through Agg), so the functions work headless, in tests and in threads.
In a notebook, run `%matplotlib inline` once; a returned figure then shows as the cell's result.

Needs the `[lab]` extra (`pip install -e '.[lab]'`, matplotlib).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

try:
    from matplotlib.figure import Figure
except ImportError as e:  # an optional extra: say how to get it
    raise ImportError("jaxengine.lab.plots needs matplotlib: pip install -e '.[lab]' "
                      "(or pip install 'matplotlib>=3.8')") from e

from jaxengine.lab.timeline import StepRecord

DECODE_COLOR, PREFILL_COLOR = "tab:blue", "tab:orange"
PREEMPT_COLOR, HIT_COLOR, RECOMMENDED_COLOR = "tab:red", "tab:green", "gold"


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencySamples:
    """Per-request latencies of one run (one policy or config)."""

    ttft_s: Sequence[float]  # time to first token of each request, seconds
    tpot_s: Sequence[float] = ()  # time per output token after the first, seconds (requests
    # with one output token have none)

    @classmethod
    def of(cls, requests: Iterable[Any]) -> LatencySamples:
        """The samples of per-request results with `ttft` and `tpot` attributes (as
        `jaxengine.lab.results.RequestResult`); None values (no token yet, one token) are
        left out."""
        requests = list(requests)
        return cls(ttft_s=[r.ttft for r in requests if r.ttft is not None],
                   tpot_s=[r.tpot for r in requests if r.tpot is not None])


@dataclass(frozen=True, slots=True, kw_only=True)
class ParetoPoint:
    """One configuration the tuner measured."""

    label: str  # names the configuration (unique within a plot)
    throughput: float  # e.g. output tokens per second; higher is better
    latency_s: float  # the latency percentile judged against the SLO; lower is better


def timeline(records: Sequence[StepRecord | Mapping[str, Any]], *, x: str = "step",
             title: str | None = None, save: str | PathLike | None = None) -> Figure:
    """A run step by step, in three panels sharing the x axis.

    Top: scheduled tokens per step as stacked areas (one stair per step, drawn as two patches
    so that thousands of steps stay fast), decode tokens below prefill tokens, with markers
    above each step that preempted (red x) or found prefix-cache hits (green triangle).
    Middle: KV-cache usage (fraction of usable blocks) as a line. Bottom: the running and
    waiting queue lengths.

    Args:
      records: one `StepRecord` per step, in order; at least one. A dict with its fields
        will do (other keys, such as the simulator's `seconds`, are ignored).
      x: "step" (the step index; each stair spans step - 0.5 to the next record's) or
        "time" (`time_s`; each stair spans until the next step's time).
      title: the figure's title.
      save: write the figure there (PNG unless the suffix names another format).
    Returns:
      The figure; its axes are (tokens, kv usage, queues).
    Raises:
      ValueError: no records, a record with missing fields, records out of order, or an
        unknown `x`.
    """
    recs = [_coerce(StepRecord, r, "records", extra_ok=True) for r in records]
    if not recs:
        raise ValueError("timeline needs at least one StepRecord; got none")
    edges, xlabel = _edges(recs, x)  # f[steps + 1]
    mid = (edges[:-1] + edges[1:]) / 2
    decode = np.array([r.decode_tokens for r in recs])
    tops = decode + np.array([r.prefill_tokens for r in recs])
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    ax_tok, ax_kv, ax_q = fig.subplots(3, 1, sharex=True, height_ratios=(3, 1.2, 1.2))
    ax_tok.stairs(decode, edges, fill=True, color=DECODE_COLOR, label="decode tokens")
    ax_tok.stairs(tops, edges, baseline=decode, fill=True, color=PREFILL_COLOR,
                  label="prefill tokens")
    _event_markers(ax_tok, recs, mid, tops)
    ax_tok.set_ylabel("scheduled tokens")
    ax_tok.legend(loc="upper right", fontsize="small")
    ax_kv.plot(mid, [r.kv_cache_usage for r in recs], color="tab:purple", label="KV usage")
    ax_kv.set_ylim(0, 1.05)
    ax_kv.set_ylabel("KV blocks used")
    ax_q.step(mid, [r.num_running for r in recs], where="mid", label="running")
    ax_q.step(mid, [r.num_waiting for r in recs], where="mid", label="waiting")
    ax_q.set_ylabel("requests")
    ax_q.set_xlabel(xlabel)
    ax_q.legend(loc="upper right", fontsize="small")
    if title:
        fig.suptitle(title)
    return _finish(fig, save)


def _edges(recs: list[StepRecord], x: str) -> tuple[np.ndarray, str]:
    """The stairs' edges, f[steps + 1] (step i spans edges[i]..edges[i + 1]), and the x label."""
    if x == "step":
        starts, last, label = np.array([r.step for r in recs], float) - 0.5, 1.0, "step"
    elif x == "time":
        starts = np.array([r.time_s for r in recs], float)
        gaps = np.diff(starts)
        last, label = (float(np.median(gaps)) if len(gaps) else 1.0), "time (s)"
    else:
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")
    # Steps must increase; times may repeat (a step the cost model gives no time).
    if np.any(np.diff(starts) < (1e-9 if x == "step" else 0.0)):
        raise ValueError(f"timeline(x={x!r}) needs records in order of increasing {x}")
    return np.append(starts, starts[-1] + max(last, 1e-9)), label


def _event_markers(ax, recs: list[StepRecord], mid: np.ndarray, tops: np.ndarray) -> None:
    """Preemptions and prefix hits as markers just above their step's bar."""
    pad = max(float(tops.max()), 1.0) * 0.06
    pre = np.array([r.num_preempted > 0 for r in recs])
    hit = np.array([r.prefix_hit_tokens > 0 for r in recs])
    if pre.any():
        ax.scatter(mid[pre], tops[pre] + pad, marker="x", color=PREEMPT_COLOR, zorder=3,
                   label=f"preemption ({sum(r.num_preempted for r in recs)})")
    if hit.any():
        ax.scatter(mid[hit], tops[hit] + 2 * pad, marker="^", color=HIT_COLOR, zorder=3,
                   label=f"prefix hit ({sum(r.prefix_hit_tokens for r in recs)} tokens)")
    ax.set_ylim(0, float(tops.max()) + 3 * pad)


def latency_cdfs(runs: Mapping[str, LatencySamples | Mapping[str, Sequence[float]]], *,
                 log_x: bool = False, title: str | None = None,
                 save: str | PathLike | None = None) -> Figure:
    """Empirical CDFs of TTFT (left) and TPOT (right), one curve per run in each panel.

    Args:
      runs: run label (a policy or config) -> its `LatencySamples` (or a dict with `ttft_s`
        and optionally `tpot_s`). A run with no samples of a metric has no curve in its panel.
      log_x: logarithmic latency axes (for latencies spanning decades).
      title: the figure's title.
      save: write the figure there (PNG unless the suffix names another format).
    Returns:
      The figure; its axes are (TTFT, TPOT), each curve labelled with its run.
    Raises:
      ValueError: no runs, or a run with missing or unknown fields.
    """
    if not runs:
        raise ValueError("latency_cdfs needs at least one run; got none")
    samples = {label: _coerce(LatencySamples, s, f"runs[{label!r}]") for label, s in runs.items()}
    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, field, name in zip(axes, ("ttft_s", "tpot_s"), ("TTFT", "TPOT"), strict=True):
        for i, (label, s) in enumerate(samples.items()):
            values = np.sort(np.asarray(getattr(s, field), float))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        color=f"C{i}", label=label)
        ax.set_xlabel(f"{name} (s)")
        if log_x:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(loc="lower right", fontsize="small")
    axes[0].set_ylabel("fraction of requests")
    axes[0].set_ylim(0, 1.02)
    if title:
        fig.suptitle(title)
    return _finish(fig, save)


def pareto_front(points: Sequence[ParetoPoint | Mapping[str, Any]], *,
                 slo_s: float | Mapping[str, float] | None = None, recommended: str | None = None,
                 front: Sequence[str] | None = None, annotate: Sequence[str] = (),
                 latency_label: str = "p99 latency (s)",
                 throughput_label: str = "throughput (output tokens/s)",
                 title: str | None = None, save: str | PathLike | None = None) -> Figure:
    """Throughput against a latency percentile for each measured configuration.

    Every point is drawn; the Pareto-optimal ones (no other point has both at least their
    throughput and at most their latency, and is better in one; or those of `front`) are
    joined by a line; each SLO is a dashed vertical line; the recommended point is a large
    star with its label; the points of `annotate` carry their labels.

    Args:
      points: the configurations (`ParetoPoint`s or dicts of their fields); at least one, with
        unique labels.
      slo_s: a latency limit in seconds, or SLO name -> limit for several lines.
      recommended: the label of the point to highlight.
      front: the labels of the points to join as the front (the tuner's: SLO-meeting ones);
        default: the Pareto-optimal points of all; empty: no line.
      annotate: labels of points to write beside them.
      latency_label: the x axis's label (say which percentile of which latency).
      throughput_label: the y axis's label.
      title: the figure's title.
      save: write the figure there (PNG unless the suffix names another format).
    Returns:
      The figure (one axes).
    Raises:
      ValueError: no points, duplicate labels, bad fields, or `recommended`, `front` or
        `annotate` naming a label that is not a point's.
    """
    pts = [_coerce(ParetoPoint, p, "points") for p in points]
    if not pts:
        raise ValueError("pareto_front needs at least one point; got none")
    labels = [p.label for p in pts]
    if len(set(labels)) != len(labels):
        raise ValueError(f"point labels must be unique; got {labels}")
    for name, given in (("recommended", [] if recommended is None else [recommended]),
                        ("front", front or ()), ("annotate", annotate)):
        unknown = [label for label in given if label not in labels]
        if unknown:
            raise ValueError(f"{name}={unknown!r} is not a point label; labels: {labels}")
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    ax.scatter([p.latency_s for p in pts], [p.throughput for p in pts], color="0.6",
               label="configurations")
    joined = pareto_indices(pts) if front is None else [labels.index(f) for f in front]
    if joined:
        line = sorted((pts[i] for i in joined), key=lambda p: (p.latency_s, p.throughput))
        ax.plot([p.latency_s for p in line], [p.throughput for p in line], "o-",
                color="tab:blue", label="Pareto front")
    for label in annotate:
        p = pts[labels.index(label)]
        ax.annotate(label, (p.latency_s, p.throughput), xytext=(6, -10),
                    textcoords="offset points", fontsize="x-small")
    slos = {"SLO": slo_s} if isinstance(slo_s, int | float) else dict(slo_s or {})
    for i, (name, limit) in enumerate(slos.items()):
        ax.axvline(limit, linestyle="--", color=f"C{i + 2}", label=f"{name} ({limit:g} s)")
    if recommended is not None:
        best = pts[labels.index(recommended)]
        ax.scatter([best.latency_s], [best.throughput], marker="*", s=300, zorder=3,
                   color=RECOMMENDED_COLOR, edgecolors="black", label=f"recommended: {best.label}")
        ax.annotate(best.label, (best.latency_s, best.throughput), xytext=(8, 8),
                    textcoords="offset points")
    ax.set_xlabel(latency_label)
    ax.set_ylabel(throughput_label)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    if title:
        ax.set_title(title)
    return _finish(fig, save)


def pareto_indices(points: Sequence[ParetoPoint]) -> list[int]:
    """Indices of the Pareto-optimal points (max throughput, min latency), in input order.

    A point is dominated when another has at least its throughput and at most its latency and
    differs in one; equal points are both kept.
    """
    return [i for i, p in enumerate(points) if not any(
        q.throughput >= p.throughput and q.latency_s <= p.latency_s
        and (q.throughput, q.latency_s) != (p.throughput, p.latency_s) for q in points)]


def _coerce[T](cls: type[T], item: T | Mapping[str, Any], where: str, *,
               extra_ok: bool = False) -> T:
    """A dataclass from itself or from a dict of its fields, with an error naming the keys;
    `extra_ok` ignores keys that are not fields."""
    if isinstance(item, cls):
        return item
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must hold {cls.__name__}s or dicts of their fields; "
                         f"got {type(item).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set() if extra_ok else set(item) - names, required - set(item)
    if unknown or missing:
        raise ValueError(f"{where}: a {cls.__name__} dict takes the keys {sorted(names)}; "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    return cls(**{k: v for k, v in item.items() if k in names})


def _finish(fig: Figure, save: str | PathLike | None) -> Figure:
    if save is not None:
        fig.savefig(save, dpi=100)
    return fig
