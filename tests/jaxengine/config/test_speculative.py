"""`speculative_config`: vLLM's defaults, errors that name the key, and the CLI's JSON flag."""

from __future__ import annotations

from typing import Any

import pytest

from jaxengine.cli import build_parser, engine_args_from, main
from jaxengine.config import SpeculativeConfig
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import create_engine_config


@pytest.mark.parametrize(("given", "bounds"), [
    ({}, (5, 5)),  # vLLM's defaults when neither bound is given
    ({"prompt_lookup_max": 3}, (3, 3)),  # one bound given: the other takes its value
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4)),
])
def test_prompt_lookup_defaults_follow_vllm(given: dict[str, int],
                                            bounds: tuple[int, int]) -> None:
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == bounds
    assert cfg.num_speculative_tokens == 3


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "medusa2", "num_speculative_tokens": 3}, "method must be one of ngram, "
                                                         "draft_model; got 'medusa2'"),
    ({"num_speculative_tokens": 3}, "method must be one of ngram, draft_model; got None"),
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 3}, "not built yet"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model .* is required"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3,
      "prompt_lookup_max": 2}, "unknown key.*'prompt_lookup_max' for method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 1},
     "unknown key.*'lookahead'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an "
                                                       "integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_name_the_key(config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(speculative_config=config)


def test_a_draft_model_config() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m",
                                       "num_speculative_tokens": 2})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/m", 2)
    with pytest.raises(ValueError, match="taken by no other"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, model="/m")


def test_the_engine_config_holds_the_parsed_dict() -> None:
    facts = dict(model_max_model_len=256, kv_bytes_per_block=64, device_kv_budget_bytes=1 << 20)
    assert create_engine_config(EngineArgs(), **facts).speculative is None
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    config = create_engine_config(args, **facts)
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert config.num_speculative_tokens == 2


def test_the_cli_flag_takes_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 4}'])
    args = engine_args_from(ns, parser)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    for bad, said in (("{method: ngram}", "not valid JSON"), ("[1]", "JSON object"),
                      ('{"method": "ngram"}', "num_speculative_tokens is required")):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--speculative-config", bad])
        assert info.value.code == 2
        assert said in capsys.readouterr().err
