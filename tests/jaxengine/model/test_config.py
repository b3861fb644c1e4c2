"""ModelConfig, the schema: presets, and validation with messages that name the values.

Reading it from HF config.json and GGUF metadata is tested with the readers
(tests/jaxengine/loading/test_hf.py, test_gguf_file.py)."""

from __future__ import annotations

import math

import pytest

from jaxengine.loading.weights import model_weight_shapes
from jaxengine.model.config import ModelConfig, ModelLoadError, RopeScaling
from jaxengine.model.families import family


def test_presets() -> None:
    weights = model_weight_shapes(ModelConfig.smollm2_135m()).values()
    assert sum(math.prod(shape) for shape in weights) == 134_515_008
    assert ModelConfig.tiny("qwen3").qk_norm
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        family("gpt2")


@pytest.mark.parametrize("overrides, message", [
    (dict(num_kv_heads=3), "num_heads=4 must be a multiple of num_kv_heads=3"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(vocab_size=0), "vocab_size must be > 0, got 0"),
])
def test_invalid_fields_are_named(overrides: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.tiny(**overrides)


def test_rope_scaling_validates_itself() -> None:
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        RopeScaling(kind="yarn", factor=4.0)
    with pytest.raises(ModelLoadError, match="factor must be > 0, got 0"):
        RopeScaling(kind="linear", factor=0)
