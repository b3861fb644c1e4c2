"""The runner: a scheduler plan in, sampled tokens out; shape buckets and compile counting."""

from jaxengine.runner.compiles import RecompileError
from jaxengine.runner.config import RunnerConfig
from jaxengine.runner.in_flight import SampledToken
from jaxengine.runner.runner import Runner

__all__ = ["RecompileError", "Runner", "RunnerConfig", "SampledToken"]
