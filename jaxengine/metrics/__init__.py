"""Engine metrics: per-step statistics, Prometheus collectors (vLLM's names) and a log line."""

from jaxengine.metrics.iteration import FinishedRequestStats, IterationStats, StepTracker
from jaxengine.metrics.log import LoggingStatLogger
from jaxengine.metrics.prometheus import PrometheusStatLogger

__all__ = [
    "FinishedRequestStats",
    "IterationStats",
    "LoggingStatLogger",
    "PrometheusStatLogger",
    "StepTracker",
]
