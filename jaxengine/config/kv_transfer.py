"""`KVTransferConfig`: vLLM's `kv_transfer_config` dict, parsed and validated.

The engine argument is the dict a user writes (`LLM(kv_transfer_config={...})`,
`jaxengine serve --kv-transfer-config '{json}'`); `KVTransferConfig.from_dict` turns it into a
frozen config or raises a `ValueError` naming the key and what to change. It makes the engine
one side of a prefill/decode disaggregated deployment (docs/DESIGN.md, "Prefill/decode
disaggregation"): a producer computes prompts and keeps their KV blocks for pickup, a consumer
loads them instead of computing them. Only the built-in connector exists, so
`{"kv_role": "kv_producer"}` alone is a whole config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

CONNECTOR = "JaxEngineConnector"  # the built-in connector (jaxengine/kv_transfer/)
ROLES = ("kv_producer", "kv_consumer", "kv_both")  # vLLM's kv_role values
DEFAULT_PORT = 14579  # vLLM's KVTransferConfig.kv_port
DEFAULT_ABORT_TIMEOUT_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
DEFAULT_FETCH_TIMEOUT_S = 60.0  # a consumer's socket timeout while it fetches a request's KV
_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config",
         "engine_id", "kv_load_failure_policy")
_EXTRA_KEYS = ("abort_timeout_s", "fetch_timeout_s", "transport")
# how pages move: "tcp" (device -> host -> our TCP protocol -> host -> device) or "jax"
# (`jax.experimental.transfer`, device to device); unset: "jax" on tpu/gpu, "tcp" on cpu
TRANSPORTS = ("tcp", "jax")
# vLLM's connectors, refused by name: they move vLLM's (torch) KV cache, not this pool's
_VLLM_CONNECTORS = ("NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1",
                    "MooncakeConnector", "OffloadingConnector", "SharedStorageConnector",
                    "MultiConnector", "DecodeBenchConnector")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferConfig:
    """Prefill/decode disaggregation settings (vLLM's names), validated when built."""

    kv_role: str  # kv_producer: serves its prompts' KV; kv_consumer: loads it; kv_both: both
    kv_connector: str = CONNECTOR  # only the built-in one
    # where a producer's transfer server listens, and the host its handles name: an address
    # the consumers reach (not 0.0.0.0)
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_PORT  # its TCP port; 0: any free port (tests, several on a host)
    engine_id: str | None = None  # names this engine in the handles it gives; None: random
    # a load that fails is recomputed locally (vLLM's default; its "fail" is not built)
    kv_load_failure_policy: str = "recompute"
    # "abort_timeout_s": a producer frees blocks nobody picked up after this many seconds;
    # "fetch_timeout_s": a consumer gives a fetch up (and recomputes) after this many;
    # "transport": one of TRANSPORTS
    kv_connector_extra_config: Mapping[str, float | str] = field(
        default_factory=lambda: MappingProxyType({}), hash=False)

    def __post_init__(self) -> None:
        if self.kv_connector != CONNECTOR:
            known = (f"; {self.kv_connector!r} is vLLM's and moves vLLM's KV cache"
                     if self.kv_connector in _VLLM_CONNECTORS else "")
            raise ValueError(f"kv_transfer_config: kv_connector must be {CONNECTOR!r} (the "
                             f"built-in one, also used when it is left out), got "
                             f"{self.kv_connector!r}{known}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}; "
                             f"got {self.kv_role!r}")
        if self.kv_load_failure_policy != "recompute":
            raise ValueError(f"kv_transfer_config: kv_load_failure_policy must be 'recompute' "
                             f"(a failed load is computed locally; 'fail' is not built), got "
                             f"{self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config: kv_ip must be a host name or address, got "
                             f"{self.kv_ip!r}")
        port = self.kv_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be an integer in [0, 65535] "
                             f"(0: any free port), got {port!r}")
        if self.engine_id is not None and not (isinstance(self.engine_id, str)
                                               and self.engine_id):
            raise ValueError(f"kv_transfer_config: engine_id must be a non-empty string, got "
                             f"{self.engine_id!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, Mapping):
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config must be a dict, "
                             f"got {extra!r}")
        for key, value in extra.items():
            if key not in _EXTRA_KEYS:
                raise ValueError(f"kv_transfer_config: kv_connector_extra_config key {key!r} "
                                 f"is not supported; it takes {', '.join(_EXTRA_KEYS)}")
            if key == "transport":
                if value not in TRANSPORTS:
                    raise ValueError(f"kv_transfer_config: kv_connector_extra_config transport "
                                     f"must be one of {', '.join(TRANSPORTS)} (left out: jax on "
                                     f"tpu/gpu, tcp on cpu), got {value!r}")
                continue
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not 0 < value < float("inf")):
                raise ValueError(f"kv_transfer_config: kv_connector_extra_config {key} must "
                                 f"be a number of seconds > 0, got {value!r}")
        object.__setattr__(self, "kv_connector_extra_config", MappingProxyType(dict(extra)))

    @property
    def is_producer(self) -> bool:
        """Serves the KV of the prompts it computes (kv_producer or kv_both)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Loads a producer's KV instead of computing it (kv_consumer or kv_both)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def abort_timeout_s(self) -> float:
        """Seconds a producer holds blocks nobody picks up."""
        return float(self.kv_connector_extra_config.get("abort_timeout_s",
                                                        DEFAULT_ABORT_TIMEOUT_S))

    @property
    def fetch_timeout_s(self) -> float:
        """Seconds a consumer waits on a producer before it recomputes the prompt."""
        return float(self.kv_connector_extra_config.get("fetch_timeout_s",
                                                        DEFAULT_FETCH_TIMEOUT_S))

    @property
    def transport(self) -> str | None:
        """The transport asked for (one of TRANSPORTS); None: the platform's default."""
        value = self.kv_connector_extra_config.get("transport")
        return None if value is None else str(value)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> KVTransferConfig:
        """Parse vLLM's `kv_transfer_config` dict.

        Args:
          config: e.g. `{"kv_role": "kv_producer", "kv_port": 14579,
            "kv_connector_extra_config": {"abort_timeout_s": 60}}`; `kv_connector` may be
            left out (the built-in one).
        Raises:
          ValueError: not a dict, no kv_role, a key or value not supported; the message
            names it.
        """
        if not isinstance(config, Mapping):
            raise ValueError(f"kv_transfer_config must be a dict such as {{'kv_role': "
                             f"'kv_producer'}}, got {type(config).__name__}")
        unknown = sorted(set(config) - set(_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown or unsupported key(s) "
                             f"{', '.join(map(repr, unknown))}; it takes {', '.join(_KEYS)}")
        if "kv_role" not in config:
            raise ValueError(f"kv_transfer_config: kv_role is required (one of "
                             f"{', '.join(ROLES)})")
        return cls(**{k: v for k, v in config.items() if v is not None or k == "kv_role"})
