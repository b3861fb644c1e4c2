"""vLLM's speculative decoding metrics: the Prometheus counters and the SpecDecoding log line,
from a run whose every draft is right (so each count is known by hand)."""

from __future__ import annotations

import logging

import pytest

from jaxengine.metrics import LoggingStatLogger, PrometheusStatLogger
from tests.jaxengine.engine.test_llm_engine import PROMPTS, make_engine
from tests.jaxengine.metrics.test_metrics import _value
from tests.jaxengine.spec.test_spec_engine import GREEDY, run, spec_engine


def test_prometheus_counters_and_the_log_line(caplog: pytest.LogCaptureFixture) -> None:
    engine = spec_engine(async_scheduling=False)  # the counts below are that loop's
    prom = PrometheusStatLogger("fake", engine.max_model_len)
    log = LoggingStatLogger(engine.snapshot().stats)
    engine.stat_loggers += [prom, log]
    run(engine, PROMPTS, GREEDY)
    text = prom.render().decode()
    n = len(PROMPTS)  # each: 12 tokens = 1 + 4 + 4 + 3, after drafts of 3, 3 and 2, all right
    assert _value(text, "jaxengine:spec_decode_num_drafts_total") == 3 * n
    assert _value(text, "jaxengine:spec_decode_num_draft_tokens_total") == 8 * n
    assert _value(text, "jaxengine:spec_decode_num_accepted_tokens_total") == 8 * n
    for pos, count in enumerate((3 * n, 3 * n, 2 * n)):
        assert _value(text, "jaxengine:spec_decode_num_accepted_tokens_per_pos_total",
                      position=str(pos), engine="0") == count
    assert _value(text, "jaxengine:generation_tokens_total") == 12 * n
    with caplog.at_level(logging.INFO, logger="jaxengine.metrics"):
        log.log(now=log._interval_start + 2.0)
    line = next(r.message for r in caplog.records if r.message.startswith("SpecDecoding"))
    assert line == (f"SpecDecoding metrics: Mean acceptance length: {1 + 8 / 3:.2f}, "
                    f"Accepted throughput: {8 * n / 2:.2f} tokens/s, "
                    f"Drafted throughput: {8 * n / 2:.2f} tokens/s, "
                    f"Accepted: {8 * n} tokens, Drafted: {8 * n} tokens, "
                    f"Per-position acceptance rate: 1.000, 1.000, 0.667, "
                    f"Avg Draft acceptance rate: 100.0%")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxengine.metrics"):
        log.log(now=log._interval_start + 2.0)  # no drafts in this interval: no line
    assert not any(r.message.startswith("SpecDecoding") for r in caplog.records)


def test_no_series_without_speculation() -> None:
    engine = make_engine()
    prom = PrometheusStatLogger("fake", engine.max_model_len)
    engine.stat_loggers.append(prom)
    run(engine, PROMPTS[:2], GREEDY)
    assert "spec_decode" not in prom.render().decode()
