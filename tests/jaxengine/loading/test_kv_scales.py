"""KV cache scales read from a checkpoint: each layer's k_scale / v_scale under the names fp8
checkpoints use, 1.0 for a layer without, None for a checkpoint without any; bad ones refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxengine.loading.hf import read_hf_config
from jaxengine.loading.kv_scales import attention_prefix
from jaxengine.loading.load import load_model
from jaxengine.model.config import ModelConfig, ModelLoadError

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama3_gqa"  # 2 layers


def _with_tensors(tmp_path: Path, extra: dict[str, np.ndarray]) -> str:
    """A copy of the tiny checkpoint with `extra` tensors beside its own."""
    out = tmp_path / "ckpt"
    shutil.copytree(TINY, out)
    tensors = load_file(out / "model.safetensors")
    save_file({**tensors, **extra}, out / "model.safetensors")
    return str(out)


def test_a_checkpoint_without_scales_has_none() -> None:
    model, cfg, _ = load_model(str(TINY), with_tokenizer=False)
    assert cfg.kv_scales is None
    assert cfg.layer_kv_scales == ((1.0, 1.0), (1.0, 1.0))
    assert model.layers[0].self_attn.kv_scales == ()


def test_each_layer_reads_its_own_scales_under_any_of_vllms_names(tmp_path: Path) -> None:
    path = _with_tensors(tmp_path, {
        "model.layers.0.self_attn.k_scale": np.array(0.5, np.float32),
        "model.layers.0.self_attn.v_scale": np.array([2.0], np.float32),
        # layer 1: llm-compressor's output scales, v only; k keeps vLLM's default 1.0
        "model.layers.1.self_attn.v_proj.output_scale": np.array(4.0, np.float32),
    })
    model, cfg, _ = load_model(path, with_tokenizer=False)
    assert cfg.kv_scales == ((0.5, 2.0), (1.0, 4.0))
    assert all(block.self_attn.kv_scales == cfg.kv_scales for block in model.layers)


@pytest.mark.parametrize(("value", "why"), [
    (np.array(0.0, np.float32), "positive finite"), (np.array(np.nan, np.float32), "finite"),
    (np.ones(2, np.float32), "one positive finite number")])
def test_a_bad_scale_is_refused_naming_the_tensor(tmp_path: Path, value: np.ndarray,
                                                  why: str) -> None:
    path = _with_tensors(tmp_path, {"model.layers.1.self_attn.k_scale": value})
    with pytest.raises(ModelLoadError, match=f"model.layers.1.self_attn.k_scale: .*{why}"):
        load_model(path, with_tokenizer=False)


def test_the_prefix_follows_the_familys_names() -> None:
    assert attention_prefix(read_hf_config(TINY)) == "model.layers.{layer}.self_attn."


def test_the_config_checks_one_positive_pair_per_layer() -> None:
    with pytest.raises(ModelLoadError, match="kv_scales has 1 entries for num_layers=2"):
        ModelConfig.tiny(kv_scales=((1.0, 1.0),))
    with pytest.raises(ModelLoadError, match=r"layer 1's KV cache scales .* got \(1.0, -1.0\)"):
        ModelConfig.tiny(kv_scales=((1.0, 1.0), (1.0, -1.0)))
