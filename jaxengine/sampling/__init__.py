"""Sampling: the jitted device sampler and the host side that validates and packs parameters."""

from jaxengine.sampling.logits_processors import LogitsAdjustments, apply_logits_processors
from jaxengine.sampling.request_tables import RequestTables
from jaxengine.sampling.rows import validate_sampling_params
from jaxengine.sampling.sampler import SamplerOutput, SamplingMetadata

__all__ = ["LogitsAdjustments", "RequestTables", "SamplerOutput",
           "SamplingMetadata", "apply_logits_processors", "validate_sampling_params"]
