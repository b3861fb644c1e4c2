"""When not to trust the lab: a poor calibration fit, a real run unlike the simulated one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from jaxengine.cli import main
from jaxengine.lab.calibrate import Sample, fit_samples, refit
from jaxengine.lab.cost_model import FEATURES, load_cost_model, save_cost_model
from jaxengine.lab.generators import scenario
from jaxengine.lab.results import save_result
from jaxengine.lab.simulate import simulate, simulation_args
from jaxengine.lab.trust import POOR_FIT_MEDIAN_ERROR, run_differences

from .test_lab_cli import hand_made_cost

LOADED = {"load_average": [3.2, 9.9], "load_samples": [4.0, 6.0, 8.0], "cpu_count": 2}


def _synthetic_calibration(noise: float) -> list[Sample]:
    """Timed calls whose seconds are a linear function of their features, times noise:
    log-normal with sigma `noise` (other processes' load)."""
    rng = np.random.default_rng(0)
    true = np.array([1e-3, 1e-4, 2e-4, 1e-5, 1e-5, 1e-5, 1e-2, 0.5])
    samples = []
    for scene in range(16):
        for _ in range(8):
            x = np.concatenate([[1.0], rng.uniform(0, 64, len(FEATURES) - 1)])
            y = x @ true * rng.lognormal(0.0, noise)
            samples.append(Sample(scene, x, float(y)))
    return samples


@pytest.mark.parametrize("noise", [0.02, 1.0])
def test_a_poor_fit_warns_with_what_to_do_and_the_file_keeps_it(
        noise: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fitted = fit_samples(_synthetic_calibration(noise))
    base = hand_made_cost(tmp_path / "base.json")
    model = dataclasses.replace(load_cost_model(base), fit=fitted.fit,
                                info=fitted.info | LOADED)
    logged: list[str] = []
    model = refit(model, log=logged.append)
    poor = model.fit.median_rel_error > POOR_FIT_MEDIAN_ERROR
    assert poor == (noise > 0.5)  # 2% noise fits within it, the log-normal of sigma 1 not
    assert len(model.info["warnings"]) == len(logged) == int(poor)
    if poor:
        message = model.info["warnings"][0]
        assert f"median error {model.fit.median_rel_error:.0%}" in message
        assert "3.20 at the start, median 6.00 while timing, 9.90 at the end, on 2 CPUs" in (
            message)
        for advice in ("quiet machine", "--repeats 3", "--max-scene-tokens"):
            assert advice in message
        assert logged == [f"calibrate: warning: {message}"]
    # The file keeps it, and the commands that read the file repeat it.
    save_cost_model(model, tmp_path / "c.json")
    assert load_cost_model(tmp_path / "c.json").info["warnings"] == model.info["warnings"]
    w = tmp_path / "w.json"
    assert main(["workload", "many_short", "--output", str(w), "--num-requests", "4",
                 "--scale", "0.06", "--vocab-size", "128"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(w), "--cost-model", str(tmp_path / "c.json")]) == 0
    assert ("the calibration's fit is poor" in capsys.readouterr().err) == poor


def test_compare_names_each_difference_between_the_real_run_and_the_simulated_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = hand_made_cost(tmp_path / "c.json")
    cost = load_cost_model(path)
    cost = dataclasses.replace(cost, info=cost.info | {"load_average": [2.2, 2.4],
                                                       "cpu_count": 2})
    save_cost_model(cost, path)
    w = scenario("many_short", num_requests=4, rate=float("inf"), seed=0, vocab_size=128,
                 scale=0.06)
    sim = simulate(w, cost, simulation_args(cost, {"max_num_seqs": 4}))
    args = sim.info["engine_args"]
    like = dataclasses.replace(sim, info={"kind": "real", "engine_args": args,
                                          "load_average": [2.0, 2.6], "backend": "cpu",
                                          "device": "cpu", "cpu_count": 2})
    assert run_differences(sim, like, cost) == []
    unlike = dataclasses.replace(like, info=like.info | {
        "engine_args": args | {"max_num_seqs": 8, "block_size": 16, "seed": 3},
        "load_average": [0.9, 1.3], "device": "TPU v5 lite"})
    found = run_differences(sim, unlike, cost)
    assert found[:3] == [
        "block_size: the real run's 16, the simulation's 4 (calibrated with 4)",
        "max_num_seqs: the real run's 8, the simulation's 4 (calibrated with 8)",
        "device: the real run's 'TPU v5 lite', the calibration's 'cpu'"]
    assert found[3].startswith("machine load: the real run's 0.90 at the start, 1.30 at the "
                               "end, on 2 CPUs; the calibration's 2.20 at the start, 2.40 at "
                               "the end, on 2 CPUs")
    assert len(found) == 4  # the seed changes no step
    save_result(unlike, tmp_path / "real.json")
    assert main(["workload", "many_short", "--output", str(tmp_path / "w.json"),
                 "--num-requests", "4", "--scale", "0.06", "--vocab-size", "128"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(tmp_path / "w.json"), "--cost-model", str(path),
                 "--max-num-seqs", "4", "--compare", str(tmp_path / "real.json")]) == 0
    err = capsys.readouterr().err
    for message in found:
        assert f"warning: {tmp_path / 'real.json'} is not the run simulated: {message}" in err
