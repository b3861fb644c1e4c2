"""The step-time cost model: features of a plan, the fit, the file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jaxengine.lab.calibrate import Sample, default_grid, fit_samples, refit
from jaxengine.lab.cost_model import (
    FEATURES,
    TOKEN_KNOTS,
    CostModel,
    fit_coefficients,
    load_cost_model,
    plan_features,
    save_cost_model,
)
from jaxengine.runner.buckets import pick_bucket, token_buckets
from scheduler import (
    Request,
    SamplingParams,
    SchedulerConfig,
    add_request,
    init_state,
    schedule,
    update_from_output,
)

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROWS = (1, 2, 4)  # sampler request buckets


def features(plan) -> dict[str, float]:
    return dict(zip(FEATURES, plan_features(plan, TOKENS, ROWS), strict=True))


def test_features_of_a_mixed_plan_by_hand() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=512,
                          num_blocks=256, block_size=4, enable_prefix_caching=False)
    s = init_state(cfg)
    for rid, n in (("a", 20), ("b", 30), ("c", 260)):
        s = add_request(s, Request(request_id=rid, prompt_token_ids=(1,) * n,
                                   sampling_params=SamplingParams(max_tokens=4)))
    s, plan = schedule(s)  # a: 20 tokens; b: 30; c: the first 206 of 260 (all from 0)
    f = features(plan)
    assert f["const"] == 1 and f["padded_tokens"] == 256 and f["num_seqs"] == 3
    assert (f["tokens_upto_8"], f["tokens_upto_128"]) == (8, 128)  # the caps
    assert f["sampler_rows"] == 2  # a and b sample; c's chunk does not
    assert f["decode_kilotokens"] == 0
    assert f["prefill_attention"] == pytest.approx(
        (20 * 10.5 + 30 * 15.5 + 206 * 103.5) / 1e6)
    s, _ = update_from_output(s, plan, {"a": [5], "b": [5]})
    s, plan = schedule(s)  # two decodes (contexts 21 and 31) and c's last 54 tokens
    f = features(plan)
    assert (f["padded_tokens"], f["tokens_upto_8"], f["tokens_upto_128"]) == (64, 8, 64)
    assert (f["num_seqs"], f["sampler_rows"]) == (3, 4)  # 3 samplers in the bucket of 4
    assert f["decode_kilotokens"] == pytest.approx((21 + 31) / 1e3)
    assert f["prefill_attention"] == pytest.approx(54 * (206 + 27.5) / 1e6)
    s, _ = update_from_output(s, plan, {"a": [5], "b": [5], "c": [5]})
    s, plan = schedule(s)  # three decodes: bucket 4, below the first cap
    f = features(plan)
    assert (f["padded_tokens"], f["tokens_upto_8"], f["tokens_upto_128"]) == (4, 4, 4)
    assert f["sampler_rows"] == 4 and f["prefill_attention"] == 0


def synthetic_features(rng: np.random.Generator, n: int) -> np.ndarray:
    """f64[n, len(FEATURES)]: plans of random buckets, samplers and contexts."""
    bucket = rng.choice([1, 2, 4, 8, 16, 64, 128, 512, 2048], n).astype(float)
    seqs = rng.integers(1, 64, n).astype(float)
    rows = rng.choice([0, 8, 16, 64], n).astype(float)
    caps = [np.minimum(bucket, k) for k in TOKEN_KNOTS]
    return np.column_stack([np.ones(n), bucket, *caps, rows, seqs, rng.random(n) * 10,
                            rng.random(n)])


def test_fit_recovers_known_coefficients_and_keeps_them_non_negative() -> None:
    rng = np.random.default_rng(0)
    x = synthetic_features(rng, 300)
    # A decode-like price: a token costs 8 ms up to 8 tokens, 2 ms up to 128, 1 ms beyond.
    true = np.array([2e-2, 1e-3, 6e-3, 1e-3, 5e-4, 5e-5, 3e-3, 0.0])
    y = x @ true * rng.normal(1.0, 0.01, 300)
    coef = fit_coefficients(x, y)
    assert coef[:7] == pytest.approx(true[:7], rel=0.1)
    assert (coef >= 0).all() and coef[7] < 1e-4
    # A feature that only lowers the time would get a negative weight: it is dropped.
    y2 = x[:, 0] * 0.01 * (1 - 0.01 * x[:, 6])
    assert (fit_coefficients(x, y2) >= 0).all()
    with pytest.raises(ValueError, match="positive times"):
        fit_coefficients(x[:3], y[:3])


def test_fit_samples_reports_held_out_scenes() -> None:
    rng = np.random.default_rng(1)
    true = np.array([1e-3, 2e-5, 1e-4, 1e-4, 5e-5, 1e-4, 1e-3, 0.5])
    samples = [Sample(scene, None, 4e-4) for scene in range(8)]
    for scene in range(8):
        for f in synthetic_features(rng, 10):
            samples.append(Sample(scene, f, float(f @ true) * rng.normal(1, 0.02)))
    model = fit_samples(samples, hold_out_every=4)
    assert model.fit is not None and model.fit.held_out_points == 20
    assert model.fit.train_points == 60 and model.fit.median_rel_error < 0.05
    assert model.idle_call_seconds == 4e-4


def test_default_grid_fits_the_engine() -> None:
    grid = default_grid(max_num_seqs=128, budget=2048, max_model_len=8192)
    assert any(s.inject for s in grid) and any(not s.inject for s in grid)
    assert all(s.decodes * s.context <= 8192 and s.decodes <= 128 for s in grid)
    assert {1, 4, 16} <= {s.decodes for s in grid}
    tiny = default_grid(max_num_seqs=4, budget=32, max_model_len=128)
    assert len(tiny) >= 4 and all(max((s.context, *s.inject)) <= 64 for s in tiny)


def test_default_grid_times_a_lone_prefill_in_every_token_bucket() -> None:
    # A prompt arriving at an idle engine (most prompts of docs/LAB.md's held-out replays) is
    # timed in every power-of-two bucket from 16 to the budget, spread through the grid.
    buckets = token_buckets(2048)
    grid = default_grid(max_num_seqs=128, budget=2048, max_model_len=8192)
    lone = [i for i, s in enumerate(grid) if s.decodes == 1]
    assert {pick_bucket(buckets, grid[i].context) for i in lone} >= {
        b for b in buckets if b >= 16}
    assert max(lone) > len(grid) * 3 // 4 and len(grid) == len(set(grid))
    tiny = default_grid(max_num_seqs=4, budget=32, max_model_len=128)
    assert {pick_bucket(token_buckets(32), min(s.context, 32)) for s in tiny
            if s.decodes == 1} >= {16, 32}


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = CostModel(coefficients={f: 0.1 * i for i, f in enumerate(FEATURES)},
                      idle_call_seconds=0.01, engine_args={"max_num_seqs": 4}, backend="cpu",
                      device="cpu", num_blocks=80, kv_bytes_per_token=512,
                      kv_budget_bytes=1 << 30, max_model_len=128, model_max_model_len=256,
                      vocab_size=128)
    model = dataclasses.replace(model, fit=fit_samples(
        [Sample(i % 8, np.array([1.0, 2, 2, 2, 8, 1, 0, 0]) * (1 + i % 3), 0.1 * (1 + i % 3))
         for i in range(40)]).fit)
    save_cost_model(model, tmp_path / "c.json")
    assert load_cost_model(tmp_path / "c.json") == model
    data = json.loads((tmp_path / "c.json").read_text())
    data["version"] = 0
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="run `jaxengine calibrate` again"):
        load_cost_model(tmp_path / "old.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_cost_model(tmp_path / "none.json")


def test_the_reweighted_fit_is_unbiased_in_the_mean_under_slow_outliers() -> None:
    rng = np.random.default_rng(2)
    x = synthetic_features(rng, 400)
    true = np.array([5e-2, 1e-3, 5e-3, 1e-3, 5e-4, 2e-3, 2e-3, 0.08])
    # Other processes' load: most calls as fast as they can be, some several times slower.
    slow = rng.random(400) < 0.2
    y = x @ true * np.where(slow, rng.uniform(2, 4, 400), rng.normal(1, 0.03, 400))
    coef = fit_coefficients(x, y, rounds=8)  # weights 1/prediction
    assert (x @ coef).sum() / y.sum() == pytest.approx(1.0, abs=0.06)
    by_measured = fit_coefficients(x, y)  # weights 1/y only: biased low
    assert (x @ by_measured).sum() / y.sum() < 0.85


def test_refit_uses_the_kept_samples() -> None:
    rng = np.random.default_rng(3)
    samples = []
    for scene in range(8):
        for f in synthetic_features(rng, 10):
            samples.append(Sample(scene, f, float(f @ [1e-2, 1e-4, 1e-3, 1e-4, 1e-4, 1e-3,
                                                       1e-3, 0])))
    model = fit_samples(samples)
    assert len(model.info["samples"]) == 80
    again = refit(model, rounds=3)
    assert again.coefficients == pytest.approx(model.coefficients, rel=1e-6, abs=1e-9)
    assert again.info["samples"] == model.info["samples"]
    with pytest.raises(ValueError, match="keeps no timed samples"):
        refit(dataclasses.replace(model, info={}))
