"""Sampling: the jitted device sampler and the host side that validates and packs parameters."""

from jaxengine.sampling.metadata import validate_sampling_params
from jaxengine.sampling.sampler import SamplerOutput, SamplingMetadata

__all__ = ["SamplerOutput", "SamplingMetadata", "validate_sampling_params"]
