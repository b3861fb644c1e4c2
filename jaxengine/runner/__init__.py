"""The runner: a scheduler plan in, sampled tokens out; shape buckets and compile counting."""

from jaxengine.runner.compiles import RecompileError
from jaxengine.runner.runner import Runner, RunnerConfig, SampledToken

__all__ = ["RecompileError", "Runner", "RunnerConfig", "SampledToken"]
