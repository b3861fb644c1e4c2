"""Quantized models over a mesh: the checks run on 8 virtual CPU devices in a child process
(`quant_mesh_checks.py` via `tests/parallel_helpers.py`); the default run takes one dense and
one MoE case, the slow run all of them."""

from __future__ import annotations

import pytest

from tests.parallel_helpers import run_pytest

CHECKS = "tests/jaxengine/model/quant/quant_mesh_checks.py"


def test_quantized_models_on_the_mesh_match_one_device() -> None:
    out = run_pytest([f"{CHECKS}::test_tp_gives_tp1s_logits_and_scales_split_with_their_"
                      f"channels[llama3_gqa-4]",
                      f"{CHECKS}::test_moe_experts_int8_on_the_mesh_give_tp1s_logits[tp]"],
                     num_devices=8, timeout=600)
    assert "2 passed" in out


@pytest.mark.slow
def test_quantized_models_on_the_mesh_match_one_device_every_case() -> None:
    out = run_pytest([CHECKS], num_devices=8, timeout=600)
    assert "6 passed" in out
