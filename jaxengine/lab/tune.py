"""The tuner: sweep scheduler settings in the simulator, keep those meeting an SLO, recommend.

Two stages keep the sweep to a few dozen simulations: first every `max_num_seqs` x
`max_num_batched_tokens` pair (`SIZES`), then, around the three best of those, the prefill
settings: `long_prefill_token_threshold`, `max_num_partial_prefills` (with
`max_long_partial_prefills` 1), `max_num_scheduled_tokens` at three quarters of the budget
(smaller steps in the same runner: its buckets still go up to the budget), chunked prefill off
(the budget raised to max_model_len, as the engine requires) and each scheduling policy it is
given (default: every registered one, `scheduler.POLICIES`, research and plug-in policies
included). A configuration meets the SLO when every limit holds (`ttft_p99=2` means the
99th-percentile TTFT is at most 2 s). The recommendation is the SLO-meeting configuration of
highest throughput (output tokens/s), ties broken by the first SLO metric; the Pareto table
lists the SLO-meeting configurations that no other beats on both throughput and that latency;
when none meets the SLO, the five closest are listed instead. Configurations with the same
outcome (throughput and every SLO metric) are listed once, as the first of them, with how many
others share it. The plot draws what the text lists (`plot_data`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxengine.engine.args import EngineArgs
from jaxengine.lab.cost_model import CostModel
from jaxengine.lab.results import METRICS, PERCENTILES, summary
from jaxengine.lab.simulate import simulate, simulation_config
from jaxengine.lab.workloads import Workload
from scheduler import POLICIES

SIZES = {"max_num_seqs": (8, 16, 32, 64, 128),
         "max_num_batched_tokens": (256, 512, 1024, 2048)}
# Configurations listed when none meets the SLO (the closest, each outcome once).
NUM_CLOSEST = 5
SWEPT = ("max_num_seqs", "max_num_batched_tokens", "max_num_scheduled_tokens",
         "long_prefill_token_threshold", "max_num_partial_prefills",
         "max_long_partial_prefills", "enable_chunked_prefill", "scheduling_policy")


def parse_slo(text: str) -> dict[str, float]:
    """`"ttft_p99=2,tpot_p99=0.2"` -> {"ttft_p99": 2.0, "tpot_p99": 0.2}.

    Raises:
      ValueError: a malformed item or an unknown metric; the message lists the known ones.
    """
    known = [f"{m}_p{q}" for m in METRICS for q in PERCENTILES] + [f"{m}_mean" for m in METRICS]
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in known:
            raise ValueError(f"unknown SLO metric {name!r} in --slo; known: {', '.join(known)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo {name}= needs a number of seconds, got {value!r}") from None
        if not out[name] > 0:
            raise ValueError(f"--slo {name} must be > 0 seconds, got {value!r}")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    """One simulated configuration."""

    settings: Mapping[str, Any]  # the SWEPT engine arguments
    summary: Mapping[str, float]  # `jaxengine.lab.results.summary` of its run
    meets_slo: bool

    @property
    def label(self) -> str:
        """A short name: seqs/budget/scheduled budget (when below the budget)/threshold/
        partial/chunked/policy."""
        s = self.settings
        scheduled = s["max_num_scheduled_tokens"]
        return (f"s{s['max_num_seqs']}/b{s['max_num_batched_tokens']}"
                f"{'' if scheduled is None else f'/n{scheduled}'}"
                f"/t{s['long_prefill_token_threshold']}/p{s['max_num_partial_prefills']}"
                f"{'' if s['enable_chunked_prefill'] else '/nochunk'}/{s['scheduling_policy']}")

    def flags(self) -> str:
        """The settings as `jaxengine` engine flags (a None setting is the flag not given)."""
        out = []
        for k, v in self.settings.items():
            if v is None:
                continue
            flag = "--" + k.replace("_", "-")
            out.append(flag if v is True else
                       "--no-" + flag[2:] if v is False else f"{flag} {v}")
        return " ".join(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneReport:
    """Every trial, the SLO, the Pareto set and the recommendation."""

    trials: tuple[Trial, ...]
    slo: Mapping[str, float]
    latency_metric: str  # the latency axis of the Pareto table
    pareto: tuple[int, ...]  # indices into trials (SLO-meeting, non-dominated), by latency
    recommended: int | None  # index into trials; None if no trial meets the SLO
    closest: tuple[int, ...]  # none meets the SLO: the NUM_CLOSEST nearest (else empty)
    alike: Mapping[int, int]  # index of a listed trial -> how many unlisted share its outcome

    @property
    def listed(self) -> tuple[int, ...]:
        """The trials the text lists, in its order: the Pareto front, else the closest."""
        return self.pareto or self.closest

    def to_json(self) -> dict[str, Any]:
        """A JSON-able object."""
        return {"slo": dict(self.slo), "latency_metric": self.latency_metric,
                "pareto": list(self.pareto), "recommended": self.recommended,
                "closest": list(self.closest),
                "trials": [{"label": t.label, "settings": dict(t.settings),
                            "summary": dict(t.summary), "meets_slo": t.meets_slo}
                           for t in self.trials]}


def _meets(s: Mapping[str, float], slo: Mapping[str, float]) -> bool:
    return all(not math.isnan(s[k]) and s[k] <= v for k, v in slo.items())


def _run(workload: Workload, cost: CostModel, base: EngineArgs, slo: Mapping[str, float],
         changes: Mapping[str, Any]) -> Trial | None:
    """Simulate `base` with `changes`; None for a combination the engine refuses."""
    try:
        args = dataclasses.replace(base, **changes)
        with warnings.catch_warnings():  # a budget beyond max_num_seqs * max_model_len is
            warnings.filterwarnings("ignore", message=".*can never be used")  # only unused
            result = simulate(workload, cost, args)
    except ValueError:
        return None
    s = summary(result)
    return Trial(settings={k: getattr(args, k) for k in SWEPT}, summary=s,
                 meets_slo=_meets(s, slo))


def _stage2(best: Trial, max_model_len: int, policies: Sequence[str]) -> list[dict[str, Any]]:
    """Prefill-setting and policy variants around a stage-1 configuration."""
    seqs, budget = best.settings["max_num_seqs"], best.settings["max_num_batched_tokens"]
    size = dict(max_num_seqs=seqs, max_num_batched_tokens=budget, max_num_scheduled_tokens=None)
    out = [dict(size, long_prefill_token_threshold=t) for t in (budget // 4, budget // 2)]
    out.append(dict(size, max_num_scheduled_tokens=budget * 3 // 4))
    out += [dict(size, max_num_partial_prefills=p, long_prefill_token_threshold=budget // 4)
            for p in (2, 4)]
    out += [dict(size, scheduling_policy=p) for p in policies]
    out.append(dict(size, enable_chunked_prefill=False,
                    max_num_batched_tokens=max(budget, max_model_len)))
    return out


def _rank(t: Trial, slo: Mapping[str, float], metric: str) -> tuple:
    """Sort key, best first: meeting the SLO, throughput, then the latency metric."""
    worst = max((t.summary[k] / v for k, v in slo.items()), default=0.0)
    return (not t.meets_slo, worst if not t.meets_slo else 0.0,
            -t.summary["output_tokens_per_s"], t.summary[metric])


def tune(workload: Workload, cost: CostModel, base: EngineArgs, *,
         slo: Mapping[str, float], sizes: Mapping[str, Sequence[int]] | None = None,
         policies: Sequence[str] | None = None) -> TuneReport:
    """Sweep the settings (module docstring) in the simulator.

    Args:
      workload: what to serve.
      cost: the calibrated cost model.
      base: every other engine argument (and the starting point of the unswept ones).
      slo: metric -> limit in seconds (`parse_slo`); empty: every configuration meets it.
      sizes: stage 1's grid (default `SIZES`).
      policies: the scheduling policies of stage 2, registered names (default: every one
        registered now).
    Raises:
      ValueError: `base` itself cannot run (`simulation_config`), a policy that is not
        registered, or no configuration of the sweep can run the workload.
    """
    policies = tuple(POLICIES) if policies is None else tuple(policies)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"tune's policies must be registered scheduling policies; got "
                         f"{list(policies)}, registered: {sorted(POLICIES)}")
    metric = next(iter(slo), "ttft_p99")
    sizes = dict(SIZES, **(sizes or {}))
    max_model_len = simulation_config(base, cost).max_model_len
    trials: dict[str, Trial] = {}

    def add(changes: Mapping[str, Any]) -> None:
        t = _run(workload, cost, base, slo, changes)
        if t is not None:
            trials.setdefault(t.label, t)

    for seqs in sizes["max_num_seqs"]:
        for budget in sizes["max_num_batched_tokens"]:
            if budget >= seqs:
                add(dict(max_num_seqs=seqs, max_num_batched_tokens=budget,
                         max_num_scheduled_tokens=None))
    if not trials:
        raise ValueError("no configuration of the sweep could run this workload (each was "
                         "refused: check max_model_len and the KV pool)")
    stage1 = sorted(trials.values(), key=lambda t: _rank(t, slo, metric))[:3]
    for best in stage1:
        for changes in _stage2(best, max_model_len, policies):
            add(changes)
    ordered = tuple(sorted(trials.values(), key=lambda t: _rank(t, slo, metric)))
    outcome = ("output_tokens_per_s", metric, *slo)
    # Of configurations with the same outcome only the best-ranked (first) is listed.
    first = [i for i, t in enumerate(ordered)
             if not any(_same(ordered[j], t, outcome) for j in range(i))]
    meeting = [i for i in first if ordered[i].meets_slo]
    pareto = tuple(sorted((i for i in meeting
                           if not any(_dominates(ordered[j], ordered[i], metric)
                                      for j in meeting)),
                          key=lambda i: ordered[i].summary[metric]))
    closest = () if meeting else tuple(first[:NUM_CLOSEST])
    alike = {i: sum(_same(ordered[i], t, outcome) for t in ordered) - 1
             for i in pareto or closest}
    return TuneReport(trials=ordered, slo=dict(slo), latency_metric=metric, pareto=pareto,
                      recommended=meeting[0] if meeting else None, closest=closest,
                      alike=alike)


def _same(a: Trial, b: Trial, keys: Sequence[str]) -> bool:
    """Whether `a` and `b` have the same outcome on the summary's `keys`."""
    return all(math.isclose(a.summary[k], b.summary[k], rel_tol=1e-9) for k in keys)


def _dominates(a: Trial, b: Trial, metric: str) -> bool:
    ta, tb = a.summary["output_tokens_per_s"], b.summary["output_tokens_per_s"]
    la, lb = a.summary[metric], b.summary[metric]
    return ta >= tb and la <= lb and (ta, la) != (tb, lb)


def format_report(report: TuneReport) -> str:
    """The Pareto table (or the closest configurations), then the recommended flags (or why
    there are none)."""
    m = report.latency_metric
    slo = ", ".join(f"{k} <= {v:g} s" for k, v in report.slo.items()) or "none"
    lines = [f"{len(report.trials)} configurations simulated; SLO: {slo}; "
             f"{sum(t.meets_slo for t in report.trials)} meet it.",
             f"Pareto front (output tokens/s against {m}, SLO-meeting):",
             f"  {'configuration':44s} {'tok/s':>9s} {m:>10s} {'ttft_p50':>9s} "
             f"{'tpot_p50':>9s} {'duration':>9s}"]
    if report.recommended is None:
        lines.append(f"  (none; the closest {len(report.closest)}:)")
    for i in report.listed:
        t = report.trials[i]
        s = t.summary
        mark = " *" if i == report.recommended else ""
        alike = f" (+{report.alike[i]} alike)" if report.alike[i] else ""
        lines.append(f"  {t.label:44s} {s['output_tokens_per_s']:9.1f} {s[m]:10.4f} "
                     f"{s['ttft_p50']:9.4f} {s['tpot_p50']:9.4f} {s['duration']:9.3f}"
                     f"{mark}{alike}")
    if report.recommended is None:
        best = report.trials[0]
        lines.append(f"no configuration meets the SLO; the closest is {best.label} "
                     f"({', '.join(f'{k} {best.summary[k]:.4f}' for k in report.slo)})")
    else:
        lines.append("recommended engine flags: " + report.trials[report.recommended].flags())
    if any(report.alike.values()):
        lines.append("(+N alike: N more configurations with the same outcome, not listed)")
    return "\n".join(lines)


def plot_data(report: TuneReport) -> dict[str, Any]:
    """What `plot` draws, as `plots.pareto_front`'s arguments: every configuration, the front
    joined through the configurations of the text's Pareto table, the ones the text lists
    labelled, the recommended one starred."""
    m = report.latency_metric
    labels = [report.trials[i].label for i in report.listed]
    rec = None if report.recommended is None else report.trials[report.recommended].label
    return {"points": [{"label": t.label, "throughput": t.summary["output_tokens_per_s"],
                        "latency_s": t.summary[m]} for t in report.trials],
            "front": [report.trials[i].label for i in report.pareto],
            "annotate": [label for label in labels if label != rec], "recommended": rec,
            "slo_s": report.slo.get(m), "latency_label": f"{m} (s)"}


def plot(report: TuneReport, path: str) -> None:
    """Draw what the text lists (`plot_data`) with `plots.pareto_front`."""
    from jaxengine.lab import plots  # here: matplotlib comes with the `lab` extra

    plots.pareto_front(**plot_data(report), save=path)
