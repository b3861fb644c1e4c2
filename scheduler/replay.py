"""Trace replay with a fake model (docs/SCHEDULING.md §10).

    python -m scheduler.replay TRACE.json [-o OUT.jsonl] [--scheduling-policy POLICY]

At step s, requests with `arrival_step == s` are added in trace order with
`arrival_time = s + 1e-6 * index`; `schedule()` runs; every request whose prompt is complete
samples `sampled_token` (EOS ignored); `update_from_output()` runs; one JSON line is printed.
When vLLM's recorded steps lie beside the trace (`TRACE.expected.jsonl`, as the conformance
traces' do), a verdict follows on stderr: "matches vLLM's N steps", or the first step that
differs (exit status 1); not under `--scheduling-policy` another policy than the trace's
(a registered name, or MODULE:CLASS imported: `resolve_policy`), whose steps vLLM did not record.
"""

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from scheduler.config import SchedulerConfig
from scheduler.core.schedule import schedule
from scheduler.core.state import init_state
from scheduler.core.update import add_request, update_from_output
from scheduler.kv.groups import KVCacheGroup
from scheduler.kv_connector import KVConnector
from scheduler.policies.policies import resolve_policy
from scheduler.request import Request, SamplingParams


def _config(fields: dict) -> SchedulerConfig:
    """The trace's config; `kv_cache_groups` is a list of KVCacheGroup fields in JSON."""
    groups = fields.get("kv_cache_groups")
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        fields = fields | {"kv_cache_groups": tuple(KVCacheGroup(**g) for g in groups)}
    return SchedulerConfig(**fields)


def replay(trace: dict, kv_connector: KVConnector | None = None) -> Iterator[dict]:
    """Yield one record per step of the trace, until every request arrived and finished
    (`kv_connector`, if given, is passed to every schedule() and update, docs §11)."""
    state = init_state(_config(trace["config"]))
    token = trace.get("sampled_token", 7)
    arrivals: dict[int, list[tuple[int, dict]]] = {}
    for index, r in enumerate(trace["requests"]):
        arrivals.setdefault(r.get("arrival_step", 0), []).append((index, r))
    last_arrival = max(arrivals, default=0)
    step = 0
    while step <= last_arrival or state.requests:
        for index, r in arrivals.get(step, ()):
            state = add_request(state, _request(r, step + 1e-6 * index))
        state, out = schedule(state, kv_connector)
        sampled = {rid: [token] for rid in out.sampling_req_ids}
        state, deltas = update_from_output(state, out, sampled, kv_connector=kv_connector)
        yield {
            "step": step,
            "num_scheduled_tokens": dict(out.num_scheduled_tokens),
            "preempted": sorted(out.preempted_req_ids),
            "finished": [d.request_id for d in deltas if d.finish_reason is not None],
            "num_free_blocks": state.num_free_blocks,
        }
        step += 1


def _request(r: dict, arrival_time: float) -> Request:
    return Request(
        request_id=r["id"], prompt_token_ids=tuple(r["prompt_token_ids"]),
        sampling_params=SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
        arrival_time=arrival_time, priority=r.get("priority", 0),
        cache_salt=r.get("cache_salt"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="trace JSON (docs/SCHEDULING.md §10)")
    parser.add_argument("-o", "--output", help="write the JSON lines here instead of stdout")
    parser.add_argument("--scheduling-policy", metavar="POLICY",
                        help="replay under this policy instead of the trace's: a registered "
                             "name or MODULE:CLASS")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        trace = json.load(f)
    own = policy = _config(trace["config"]).policy
    if args.scheduling_policy is not None:
        try:
            policy = resolve_policy(args.scheduling_policy)
        except ValueError as e:
            parser.error(str(e))
        trace = trace | {"config": trace["config"] | {"policy": policy}}
    records = []
    with open(args.output, "w") if args.output else contextlib.nullcontext(sys.stdout) as out:
        for record in replay(trace):
            records.append(record)
            out.write(json.dumps(record) + "\n")
    expected_path = expected_steps_path(args.trace)
    if not expected_path.is_file():
        return 0
    if policy != own:
        print(f"no verdict: vLLM's steps ({expected_path}) are of the trace's policy {own!r}",
              file=sys.stderr)
        return 0
    expected = [json.loads(line) for line in expected_path.read_text().splitlines() if line]
    difference = first_difference(records, expected)
    if difference is None:
        print(f"matches vLLM's {len(expected)} steps ({expected_path})", file=sys.stderr)
        return 0
    print(f"differs from vLLM's steps ({expected_path}): {difference}", file=sys.stderr)
    return 1


def expected_steps_path(trace: str | Path) -> Path:
    """Where vLLM's recorded steps of `trace` lie: `cNNN.json` -> `cNNN.expected.jsonl`."""
    return Path(trace).with_suffix(".expected.jsonl")


# The fields of a step record that must agree, each as compared (docs/SCHEDULING.md §10).
_COMPARED = {"step": int, "num_scheduled_tokens": lambda d: list(d.items()),
             "preempted": sorted, "finished": sorted, "num_free_blocks": int}


def first_difference(got: Sequence[dict], expected: Sequence[dict]) -> str | None:
    """The first step where replay records `got` differ from `expected` (vLLM's), in words;
    None if they agree: at every step the same `num_scheduled_tokens` in the same order, the
    same `preempted` and `finished` sets and the same `num_free_blocks` (docs/SCHEDULING.md
    §10), and as many steps."""
    for ours, theirs in zip(got, expected, strict=False):
        fields = [k for k in _COMPARED if _COMPARED[k](ours[k]) != _COMPARED[k](theirs[k])]
        if fields:
            return f"step {ours['step']}: " + "; ".join(
                f"{k} {ours[k]} here, {theirs[k]} in vLLM" for k in fields)
    if len(got) != len(expected):
        return f"vLLM took {len(expected)} steps, the replay {len(got)}"
    return None


if __name__ == "__main__":
    sys.exit(main())
