"""Engine metrics: the engine's step statistics (`jaxengine.engine.stats`) recorded as
Prometheus collectors with vLLM's names, and as vLLM's periodic log line, per data-parallel
replica (`EngineStatLogger`); read back as values in vLLM's shape (`get_metrics_snapshot`)."""

from jaxengine.metrics.log import LoggingStatLogger
from jaxengine.metrics.prometheus import PrometheusStatLogger, cache_config_info
from jaxengine.metrics.reader import (
    Counter,
    Gauge,
    Histogram,
    Metric,
    Vector,
    aggregate_engines,
    get_metrics_snapshot,
)
from jaxengine.metrics.replicas import EngineStatLogger, IndexedStatLogger, attach_stat_loggers

__all__ = ["Counter", "EngineStatLogger", "Gauge", "Histogram", "IndexedStatLogger",
           "LoggingStatLogger", "Metric", "PrometheusStatLogger", "Vector", "aggregate_engines",
           "attach_stat_loggers", "cache_config_info", "get_metrics_snapshot"]
