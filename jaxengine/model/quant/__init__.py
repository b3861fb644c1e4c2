"""Quantized weights (`quantization="int8"` / `"fp8"` / `"gguf"`): formats, modules and the
swap."""

from jaxengine.model.quant.channel import FP8, INT8, ChannelFormat, dequantize, quantize
from jaxengine.model.quant.formats import (
    FORMATS,
    QUANTIZATIONS,
    PerChannel,
    WeightFormat,
    check_platform,
    quantize_modules,
    weight_format,
)
from jaxengine.model.quant.gguf import GGUFEmbedder, GGUFExperts, GGUFFormat, GGUFLinear
from jaxengine.model.quant.modules import (
    QuantizedEmbedder,
    QuantizedExperts,
    QuantizedLinear,
    scale_name,
)

__all__ = ["FORMATS", "FP8", "INT8", "QUANTIZATIONS", "ChannelFormat", "GGUFEmbedder",
           "GGUFExperts", "GGUFFormat", "GGUFLinear", "PerChannel",
           "QuantizedEmbedder", "QuantizedExperts", "QuantizedLinear", "WeightFormat",
           "check_platform", "dequantize", "quantize", "quantize_modules", "scale_name",
           "weight_format"]
