"""Quantized models on 8 virtual CPU devices, run in a child process by test_quant_mesh.py: jax
must see the devices from its first import, so this module is not collected by the default run
(no `test_` prefix; `tests/parallel_helpers.py`)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxengine.loading import load_model
from jaxengine.model.batch import RequestChunk, pack_batch
from jaxengine.model.kv_cache import init_kv_cache
from jaxengine.model.mesh import TP_AXIS, make_mesh
from jaxengine.model.step import make_compute_logits, make_model_step, split_model

if len(jax.devices()) < 8:
    raise RuntimeError(f"these checks need 8 devices, jax sees {len(jax.devices())}: run them "
                       "through tests/parallel_helpers.py (XLA_FLAGS=--xla_force_host_platform_"
                       "device_count=8)")

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "tiny"
IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 3, 1, 4]
# int8 takes its groups of inputs within each device's part (quant/channel.py): these models'
# row-parallel parts are under 32 inputs at tp > 1, so their groups are finer than at tp=1 and
# the logits differ by int8's rounding (a scale on the wrong weights would be off by ~1).
TOL = 0.05


def logits(path: Path, tp: int, **kw: object) -> tuple[np.ndarray, object]:
    """The fixture's int8 model on `tp` devices, one prefill: f32[len(IDS), V] and the model."""
    mesh = make_mesh(jax.devices()[:tp])
    model, cfg, _ = load_model(str(path), with_tokenizer=False, mesh=mesh,
                               quantization="int8", **kw)
    graph, state = split_model(model)
    kv = init_kv_cache(cfg, num_blocks=8, block_size=4, dtype=model.dtype,
                       num_kv_heads=model.layout.num_kv_heads, mesh=mesh)
    batch = pack_batch([RequestChunk(token_ids=IDS, start=0, block_table=[1, 2, 3])],
                       num_tokens=16, max_seqs=2, max_blocks=4, block_size=4)
    _, hidden = jax.jit(make_model_step(graph))(state, kv, batch)
    out = jax.jit(make_compute_logits(graph))(state, hidden)
    return np.asarray(out)[:len(IDS)], model


def spec(var: nnx.Variable) -> P:
    return var.get_value().sharding.spec


def dequantized(module: nnx.Module, name: str = "kernel") -> tuple[np.ndarray, np.ndarray]:
    """`module`'s int8 weight `name` gathered and dequantized, f64[..., in, out], and each
    weight's scale (its group's) alike."""
    values = np.asarray(getattr(module, name).get_value()).astype(np.float64)
    scale = np.asarray(getattr(module, f"{name}_scale").get_value()).astype(np.float64)
    scale = np.repeat(scale, values.shape[-2] // scale.shape[-2], axis=-2)
    return values * scale, scale


def assert_same_weights(a: nnx.Module, b: nnx.Module, name: str = "kernel") -> None:
    """Two quantizations of one float weight (groups of any size): each within half a step of
    the float weight, so within half of each's step of each other."""
    (wa, sa), (wb, sb) = dequantized(a, name), dequantized(b, name)
    assert np.all(np.abs(wa - wb) <= (sa + sb) / 2 * (1 + 1e-6))


@pytest.mark.parametrize("name, tp", [("llama3_gqa", 2), ("llama3_gqa", 4),
                                      ("qwen2_bias_tied", 2), ("gemma2_softcap", 2)])
def test_tp_gives_tp1s_logits_and_scales_split_with_their_channels(name: str, tp: int) -> None:
    path = FIXTURES / name
    one, model_1 = logits(path, 1)
    many, model = logits(path, tp)
    np.testing.assert_allclose(many, one, atol=TOL, rtol=0)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    # the scales [in / group, out] split exactly as their weights
    assert spec(attn.q_proj.kernel) == spec(attn.q_proj.kernel_scale) == P(None, TP_AXIS)
    assert spec(attn.o_proj.kernel) == spec(attn.o_proj.kernel_scale) == P(TP_AXIS, None)
    assert spec(mlp.down_proj.kernel_scale) == P(TP_AXIS, None)
    assert spec(model.embed_tokens.embedding_scale) == P(TP_AXIS, None)  # with the vocab rows
    if model.lm_head is not None:
        assert spec(model.lm_head.kernel_scale) == P(None, TP_AXIS)
    for a, b in ((attn.o_proj, model_1.layers[0].self_attn.o_proj),
                 (mlp.down_proj, model_1.layers[0].mlp.down_proj)):
        assert_same_weights(a, b)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_moe_experts_int8_on_the_mesh_give_tp1s_logits(expert_parallel: bool) -> None:
    path = FIXTURES / "qwen2_moe"
    one, model_1 = logits(path, 1)
    many, model = logits(path, 2, expert_parallel=expert_parallel)
    np.testing.assert_allclose(many, one, atol=TOL, rtol=0)
    experts = model.layers[0].moe.experts
    if expert_parallel:
        assert spec(experts.gate_proj_scale) == P(TP_AXIS, None, None)
    else:
        assert spec(experts.gate_proj_scale) == P(None, None, TP_AXIS)
        assert spec(experts.down_proj_scale) == P(None, TP_AXIS, None)
    assert_same_weights(experts, model_1.layers[0].moe.experts, "down_proj")
