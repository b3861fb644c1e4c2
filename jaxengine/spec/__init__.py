"""Speculative decoding (vLLM's `speculative_config`): drafts proposed on the host, verified in
one target step.

`SpeculativeConfig` parses the engine argument; `propose_ngram` drafts by prompt lookup;
`jaxengine.runner.verify` holds the runner's side (which hidden rows to gather, which sampler
rows to draw) and why accepting the drafts the target samples is exact;
`jaxengine.spec.speculator.Speculator` is the engine's side, and `SpecDecodingStats` what a step
reports. docs/DESIGN.md, "Speculative decoding". This package's root imports no jax (the
engine arguments read it).
"""

from jaxengine.spec.config import SpeculativeConfig
from jaxengine.spec.metrics import SpecDecodingStats
from jaxengine.spec.ngram import propose_ngram

__all__ = ["SpecDecodingStats", "SpeculativeConfig", "propose_ngram"]
