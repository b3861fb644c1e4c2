"""`kv_transfer_config`: vLLM's dict parsed into `KVTransferConfig`, on `EngineArgs` and the
command line, and refused clearly where it cannot serve."""

from __future__ import annotations

from typing import Any

import pytest

from jaxengine.cli import build_parser, engine_args_from
from jaxengine.config import KVTransferConfig
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import check_kv_cache_groups
from jaxengine.kv_transfer.worker import choose_transport
from scheduler.kv.groups import FULL_ATTENTION, KVCacheGroup


def test_a_role_alone_is_a_whole_config_with_vllms_defaults() -> None:
    config = KVTransferConfig.from_dict({"kv_role": "kv_producer"})
    assert config.kv_connector == "JaxEngineConnector"
    assert (config.kv_ip, config.kv_port) == ("127.0.0.1", 14579)
    assert config.abort_timeout_s == 480.0
    assert config.is_producer and not config.is_consumer
    both = KVTransferConfig.from_dict({"kv_role": "kv_both", "kv_connector": None,
                                       "kv_connector_extra_config": {"abort_timeout_s": 5}})
    assert both.is_producer and both.is_consumer and both.abort_timeout_s == 5.0


def test_the_transport_is_jax_on_accelerators_and_tcp_on_cpu_unless_set() -> None:
    plain = KVTransferConfig.from_dict({"kv_role": "kv_producer"})
    assert [choose_transport(plain, p) for p in ("cpu", "gpu", "tpu")] == ["tcp", "jax", "jax"]
    tcp = KVTransferConfig.from_dict({"kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"transport": "tcp"}})
    jax_ = KVTransferConfig.from_dict({"kv_role": "kv_producer",
                                       "kv_connector_extra_config": {"transport": "jax"}})
    assert (choose_transport(tcp, "gpu"), choose_transport(jax_, "cpu")) == ("tcp", "jax")


@pytest.mark.parametrize(("config", "message"), [
    ({}, "kv_role is required"),
    ({"kv_role": "producer"}, "kv_role must be one of kv_producer, kv_consumer, kv_both"),
    ({"kv_role": "kv_producer", "kv_connector": "NixlConnector"},
     "kv_connector must be 'JaxEngineConnector'.*'NixlConnector' is vLLM's"),
    ({"kv_role": "kv_producer", "kv_buffer_size": 1e9}, "unknown or unsupported key.*"
     "'kv_buffer_size'"),
    ({"kv_role": "kv_producer", "kv_port": 70000}, "kv_port must be an integer in"),
    ({"kv_role": "kv_consumer", "kv_connector_extra_config": {"backends": ["UCX"]}},
     "kv_connector_extra_config key 'backends' is not supported"),
    ({"kv_role": "kv_consumer", "kv_connector_extra_config": {"abort_timeout_s": -1}},
     "abort_timeout_s must be a number of seconds > 0"),
    ({"kv_role": "kv_consumer", "kv_load_failure_policy": "fail"},
     "kv_load_failure_policy must be 'recompute'"),
    ("kv_producer", "kv_transfer_config must be a dict"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {"transport": "nixl"}},
     "transport must be one of tcp, jax .*got 'nixl'"),
])
def test_a_bad_config_is_refused_naming_the_key(config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(kv_transfer_config=config)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(kv_offloading_size=1), "cannot be combined with kv_offloading_size=1"),
    (dict(data_parallel_size=2), "needs data_parallel_size=1"),
])
def test_settings_it_cannot_serve_with_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(kv_transfer_config={"kv_role": "kv_both"}, **kw)


def test_a_model_with_several_kv_cache_groups_is_refused() -> None:
    sliding = KVCacheGroup(num_layers=1, sliding_window=8)
    args = EngineArgs(kv_transfer_config={"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="kv_transfer_config is not supported for a model"):
        check_kv_cache_groups(args, (FULL_ATTENTION, sliding))


def test_the_command_line_takes_a_json_config(capsys) -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--kv-transfer-config", '{"kv_role": "kv_consumer"}'])
    assert engine_args_from(ns, parser).kv_transfer_config == {"kv_role": "kv_consumer"}
    ns = parser.parse_args(["serve", "--kv-transfer-config", '{"kv_role": "decode"}'])
    with pytest.raises(SystemExit):
        engine_args_from(ns, parser)
    assert "kv_role must be one of" in capsys.readouterr().err
