"""Speculative decoding (vLLM's `speculative_config`): drafts proposed on the host, verified in
one target step.

`jaxengine.config.SpeculativeConfig` is the parsed engine argument; `propose_ngram` drafts by
prompt lookup; `jaxengine.runner.verify` holds the runner's side (which hidden rows to gather,
which sampler rows to draw) and why accepting the drafts the target samples is exact;
`jaxengine.spec.speculator.Speculator` is the engine's side, and `SpecDecodingStats` what a step
reports. A draft model's functions come from the engine's build
(`jaxengine.engine.build.load_draft`). docs/DESIGN.md, "Speculative decoding".
"""

from jaxengine.spec.metrics import SpecDecodingStats
from jaxengine.spec.ngram import propose_ngram

__all__ = ["SpecDecodingStats", "propose_ngram"]
