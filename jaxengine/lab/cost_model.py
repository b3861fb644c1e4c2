"""A step-time model: what one `LLMEngine.step()` call costs, from the plan it completes.

The cost of a call is a linear function of a few physically meaningful features of the plan
whose tokens it delivers (with async scheduling that is the plan dispatched by the call
before; the synchronous loop completes its own):

- `const`: the per-call host work (scheduling, packing, detokenizing, updating) and dispatch;
- `padded_tokens`: the token bucket the step runs in (every matmul is over the padded batch);
- `tokens_upto_8`, `tokens_upto_128`: the bucket again, capped at 8 and 128 tokens: with the
  non-negative fit, a token costs more in small buckets than in large ones (a piecewise linear,
  concave price of the bucket). Small steps multiply a few rows by every weight (bound by
  streaming the weights), large ones run the matmuls near peak; one slope fitted over both
  is set by the large prefill steps and prices decodes far below their measured time
  (docs/LAB.md);
- `sampler_rows`: the sampler's request bucket (`jaxengine.runner.buckets.request_buckets`)
  of the requests that sample: every row, padding included, multiplies by the lm head
  (576 x 49152 for SmolLM2), whatever the token bucket;
- `num_seqs`: requests in the step (packing, sampling and output work per request);
- `decode_kilotokens`: context tokens read by the decode pass (one-token requests), / 1000;
- `prefill_attention`: causal attention work of the longer chunks,
  sum of q * (computed + (q + 1) / 2) over chunks of q tokens after `computed`, / 1e6.

A call that completes no plan (the first one of an async run, or one after an empty plan) costs
`idle_call_seconds`. The coefficients are fitted by `fit_coefficients` (least squares on
relative error, non-negative; numpy only) from timed calls:
`jaxengine.lab.calibrate` makes them on the machine, for the engine arguments it saves
alongside.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxengine.runner.buckets import pick_bucket
from scheduler import SchedulerOutput

# The caps of the `tokens_upto_*` features (token buckets where the price per token changes).
TOKEN_KNOTS = (8, 128)
FEATURES = ("const", "padded_tokens", *(f"tokens_upto_{k}" for k in TOKEN_KNOTS),
            "sampler_rows", "num_seqs", "decode_kilotokens", "prefill_attention")
# Engine arguments a cost model is only valid for: they change the work of a step or the loop.
CALIBRATION_KEYS = ("model", "dtype", "kv_cache_dtype", "attention_backend",
                    "tensor_parallel_size", "async_scheduling")
# 2: the tokens_upto_* and sampler_rows features; 3: the attention backend recorded as resolved
# (a version-2 file's None meant the jnp reference on CPU, which the native kernel replaced);
# 4: CPU steps with the projections packed for the native matmul (every step's price changed);
# 5: CPU steps whose packed projections skip the padding rows, with RoPE's tables computed once
# and the attention kernel's new prefill and decode paths (every step's price changed again);
# 6: CPU steps with the tied LM head packed, SwiGLU fused into the packed matmul and the
# attention metadata cut to the step's rows (the sampler's and every step's price changed)
VERSION = 6


def plan_features(plan: SchedulerOutput, buckets: Sequence[int],
                  request_buckets: Sequence[int]) -> np.ndarray:
    """The `FEATURES` of one plan, f64[len(FEATURES)].

    Args:
      plan: the step's plan (non-empty).
      buckets: the engine's token buckets (`jaxengine.runner.buckets.token_buckets`).
      request_buckets: the sampler's (`jaxengine.runner.buckets.request_buckets`).
    """
    decode_ctx, prefill, seqs = 0, 0.0, 0
    computed = plan.num_computed_tokens
    for rid, q in plan.num_scheduled_tokens.items():
        seqs += 1
        if q == 1:
            decode_ctx += computed[rid] + 1
        else:
            prefill += q * (computed[rid] + (q + 1) / 2)
    bucket = pick_bucket(buckets, plan.total_num_scheduled_tokens)
    sampling = len(plan.sampling_req_ids)
    rows = pick_bucket(request_buckets, sampling) if sampling else 0
    return np.array([1.0, float(bucket), *(float(min(bucket, k)) for k in TOKEN_KNOTS),
                     float(rows), float(seqs), decode_ctx / 1e3, prefill / 1e6])


@dataclass(frozen=True, slots=True, kw_only=True)
class FitReport:
    """How well a fit predicts timed calls it did not see."""

    train_points: int
    held_out_points: int
    median_rel_error: float  # |predicted / measured - 1| over the held-out calls
    p90_rel_error: float
    max_rel_error: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Fitted step costs and what they were calibrated for (saved as JSON)."""

    coefficients: Mapping[str, float]  # seconds per unit of each of FEATURES
    idle_call_seconds: float  # a call that completes no plan
    engine_args: Mapping[str, Any]  # the EngineArgs fields it was calibrated with
    backend: str  # jax.default_backend() at calibration
    device: str  # the device's description
    num_blocks: int  # the calibrated engine's KV pool (null block included)
    kv_bytes_per_token: int  # KV bytes of one token's slot (sizes pools of other block sizes)
    kv_budget_bytes: int  # the KV budget it was sized from
    max_model_len: int  # the resolved max_model_len
    model_max_model_len: int  # the model's own limit
    vocab_size: int
    fit: FitReport | None = None
    info: Mapping[str, Any] = field(default_factory=dict)  # when, how many points, grid, ...

    def __post_init__(self) -> None:
        missing = set(FEATURES) - set(self.coefficients)
        if missing:
            raise ValueError(f"cost model lacks coefficients for {sorted(missing)}")

    def step_seconds(self, plan: SchedulerOutput | None, buckets: Sequence[int],
                     request_buckets: Sequence[int]) -> float:
        """Predicted seconds of a call that completes `plan` (None or empty: an idle call),
        on an engine with these token and sampler buckets (see `plan_features`)."""
        if plan is None or not plan.num_scheduled_tokens:
            return self.idle_call_seconds
        return float(np.dot(self._vector(), plan_features(plan, buckets, request_buckets)))

    def _vector(self) -> np.ndarray:
        return np.array([self.coefficients[f] for f in FEATURES])

    def to_json(self) -> dict[str, Any]:
        """The file format."""
        out = asdict(self)
        out["version"] = VERSION
        out["features"] = list(FEATURES)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostModel:
        """Read the file format back.

        Raises:
          ValueError: not a cost model file of this version.
        """
        if data.get("version") != VERSION or list(data.get("features", ())) != list(FEATURES):
            raise ValueError(f"not a cost model of version {VERSION} with features "
                             f"{list(FEATURES)}: run `jaxengine calibrate` again")
        fields = {k: v for k, v in data.items() if k not in ("version", "features")}
        if fields.get("fit") is not None:
            fields["fit"] = FitReport(**fields["fit"])
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"malformed cost model: {e}") from None


def save_cost_model(model: CostModel, path: str | Path) -> None:
    """Write `model` as JSON."""
    with open(path, "w") as f:
        json.dump(model.to_json(), f, indent=1)
        f.write("\n")


def load_cost_model(path: str | Path) -> CostModel:
    """Read a cost model written by `save_cost_model` (or `jaxengine calibrate`).

    Raises:
      ValueError: a missing or malformed file; the message says to recalibrate.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"cost model {str(path)!r} does not exist; make one with "
                         "`jaxengine calibrate --output COST.json`") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"cost model {str(path)!r} is not valid JSON: {e}") from None
    return CostModel.from_json(data)


def fit_coefficients(x: np.ndarray, y: np.ndarray, *, rounds: int = 0) -> np.ndarray:
    """Non-negative coefficients fitting x @ c to y by relative error.

    Each call counts by its error relative to its measured time (weights 1/y). With
    `rounds` > 0 the weights become 1/prediction, refitted that many times (iteratively
    reweighted least squares: the quasi-likelihood of times with multiplicative noise), which
    is unbiased in the mean: weights 1/y fit low when the noise has a slow tail (other load on
    the machine). docs/LAB.md has the measured bias of each and why `jaxengine.lab.calibrate`
    uses 8 rounds.

    Args:
      x: f64[n, len(FEATURES)] features of n timed calls.
      y: f64[n] their measured seconds (> 0).
      rounds: reweighting rounds after the first fit (0: weights 1/y only).
    Returns:
      f64[len(FEATURES)].
    """
    if len(y) < x.shape[1] or np.any(y <= 0):
        raise ValueError(f"need at least {x.shape[1]} timed calls with positive times, "
                         f"got {len(y)}")
    coef = _nonnegative_lstsq(x, y, 1.0 / y)
    for _ in range(rounds):
        coef = _nonnegative_lstsq(x, y, 1.0 / np.maximum(x @ coef, 1e-3 * y.min()))
    return coef


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Least squares of (x @ c - y) * w with c >= 0: a feature whose coefficient comes out
    negative is dropped and the rest refitted, until none is (an active-set heuristic: no
    feature may make a step cheaper)."""
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            out = np.zeros(x.shape[1])
            out[active] = np.maximum(coef, 0.0)
            return out
        active.pop(int(np.argmin(coef)))


def relative_errors(coef: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """|x @ coef / y - 1| per call, f64[n]."""
    return np.abs(x @ coef / y - 1.0)


def fit_report(coef: np.ndarray, x_train: np.ndarray, x_test: np.ndarray,
               y_test: np.ndarray) -> FitReport:
    """The held-out errors of `coef`."""
    err = relative_errors(coef, x_test, y_test)
    return FitReport(train_points=len(x_train), held_out_points=len(x_test),
                     median_rel_error=float(np.median(err)),
                     p90_rel_error=float(np.percentile(err, 90)),
                     max_rel_error=float(err.max()))
