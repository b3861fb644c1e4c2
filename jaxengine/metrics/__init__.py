"""Engine metrics: the engine's step statistics (`jaxengine.engine.stats`) recorded as
Prometheus collectors with vLLM's names, and as vLLM's periodic log line."""

from jaxengine.metrics.log import LoggingStatLogger
from jaxengine.metrics.prometheus import PrometheusStatLogger

__all__ = ["LoggingStatLogger", "PrometheusStatLogger"]
