"""A request's `kv_transfer_params` (vLLM's name and keys): parsed, checked, and the handle a
producer gives back.

A client (the proxy) asks a producer for `{"do_remote_decode": true}`; the producer's finished
output carries a handle, `{"do_remote_prefill": true, "remote_host": ..., "remote_port": ...,
"remote_request_id": ..., ...}`, which the client passes on to a consumer. The handle also
names the layout the pages travel in (the pool's own: page shape, dtype, block size, tensor
parallel size), so that a consumer whose pool differs refuses the request before it allocates
anything, rather than writing pages of another layout into its pool, and the transport they
travel by (`remote_transport`: "tcp", or "jax" with the id of the offered pages,
`remote_transfer_id`), which a consumer of another transport refuses the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# vLLM's keys (NIXL's handle) and ours; vLLM's proxies send the handle's keys as None too
_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id",
         "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens",
         "remote_block_size", "remote_kv_dtype", "remote_page_shape", "tp_size",
         "remote_transport", "remote_transfer_id")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """How one engine's KV pages look on the host: equal layouts can exchange pages."""

    page_shape: tuple[int, ...]  # one page, all layers, every KV head (whole, not a shard)
    dtype: str  # the pool's dtype, e.g. "float32"
    block_size: int  # tokens per page
    tp_size: int  # tensor-parallel devices the pool is split over


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """do_remote_decode: hold the request's KV for a consumer's pickup when it finishes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteHandle:
    """Where a consumer fetches a request's KV from (a producer's handle, checked)."""

    host: str
    port: int
    request_id: str  # the request's id on the producer
    engine_id: str | None  # the producer's name (logs)
    num_tokens: int  # prompt tokens whose KV the producer holds
    transport: str  # "tcp" (host, port: its TransferServer) or "jax" (its DeviceTransferServer)
    transfer_id: int | None  # jax: the id its pages are offered under


def parse(params: Any, *, num_prompt_tokens: int, layout: KVLayout, transport: str,
          producer: bool, consumer: bool) -> RemoteDecode | RemoteHandle | None:
    """What a request's `kv_transfer_params` asks of this engine.

    Args:
      params: the request's `kv_transfer_params`.
      num_prompt_tokens: its prompt's length here.
      layout: this engine's pages.
      transport: this engine's transport ("tcp" or "jax").
      producer, consumer: this engine's role (`KVTransferConfig.is_producer` / `is_consumer`).
    Returns:
      `RemoteDecode` for do_remote_decode; a `RemoteHandle` for do_remote_prefill (load its
      KV from there); None: neither.
    Raises:
      ValueError: not a dict, an unknown key, a role this engine does not have, a missing or
        bad handle field, or a handle whose layout, transport or prompt length differs from
        this engine's; the message names the key.
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"kv_transfer_params must be a dict such as "
                         f'{{"do_remote_decode": true}}, got {params!r}')
    unknown = sorted(set(params) - set(_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown key(s) {', '.join(map(repr, unknown))};"
                         f" it takes {', '.join(_KEYS)}")
    decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if decode and prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are both "
                         "true; a request is either prefilled for another engine or decoded "
                         "from another engine's prefill")
    if decode:
        if not producer:
            raise ValueError("kv_transfer_params: do_remote_decode needs an engine whose "
                             "kv_transfer_config kv_role is kv_producer or kv_both")
        return RemoteDecode()
    if not prefill:
        return None
    if not consumer:
        raise ValueError("kv_transfer_params: do_remote_prefill needs an engine whose "
                         "kv_transfer_config kv_role is kv_consumer or kv_both")
    return _remote_handle(params, num_prompt_tokens, layout, transport)


def _remote_handle(params: Mapping[str, Any], num_prompt_tokens: int,
                   layout: KVLayout, transport: str) -> RemoteHandle:
    for key in ("remote_host", "remote_request_id", "remote_kv_dtype", "remote_transport"):
        if not isinstance(params.get(key), str) or not params[key]:
            raise ValueError(f"kv_transfer_params: {key} must be a non-empty string (the "
                             f"producer's handle), got {params.get(key)!r}")
    for key in ("remote_port", "remote_num_tokens", "remote_block_size", "tp_size"):
        value = params.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"kv_transfer_params: {key} must be an integer >= 1 (the "
                             f"producer's handle), got {value!r}")
    shape = params.get("remote_page_shape")
    if not isinstance(shape, list | tuple) or not all(isinstance(d, int) for d in shape):
        raise ValueError(f"kv_transfer_params: remote_page_shape must be a list of integers "
                         f"(the producer's handle), got {shape!r}")
    theirs = KVLayout(page_shape=tuple(shape), dtype=params["remote_kv_dtype"],
                      block_size=params["remote_block_size"], tp_size=params["tp_size"])
    for name in ("block_size", "dtype", "tp_size", "page_shape"):
        if getattr(theirs, name) != getattr(layout, name):
            raise ValueError(
                f"kv_transfer_params: the producer's KV pages have {name} "
                f"{getattr(theirs, name)!r}, this engine's {getattr(layout, name)!r}; pages "
                f"move in the pool's own layout, so serve both with the same model, "
                f"block_size, kv_cache_dtype and tensor_parallel_size")
    if params["remote_transport"] != transport:
        raise ValueError(f"kv_transfer_params: the producer's pages move by remote_transport "
                         f"{params['remote_transport']!r}, this engine's transport is "
                         f"{transport!r}; give both the same kv_connector_extra_config "
                         f"transport")
    transfer_id = params.get("remote_transfer_id")
    if transport == "jax" and (not isinstance(transfer_id, int) or isinstance(transfer_id, bool)
                               or transfer_id < 0):
        raise ValueError(f"kv_transfer_params: remote_transfer_id must be an integer >= 0 "
                         f"(the producer's handle), got {transfer_id!r}")
    if params["remote_num_tokens"] != num_prompt_tokens:
        raise ValueError(f"kv_transfer_params: the producer computed "
                         f"{params['remote_num_tokens']} prompt tokens, this prompt has "
                         f"{num_prompt_tokens}; send the decode instance the prompt the "
                         f"prefill instance was sent")
    return RemoteHandle(host=params["remote_host"], port=params["remote_port"],
                        request_id=params["remote_request_id"],
                        engine_id=params.get("remote_engine_id"),
                        num_tokens=params["remote_num_tokens"], transport=transport,
                        transfer_id=transfer_id if transport == "jax" else None)


def handle(*, engine_id: str, host: str, port: int, request_id: str, num_tokens: int,
           layout: KVLayout, transport: str, transfer_id: int | None) -> dict[str, Any]:
    """The `kv_transfer_params` a producer's finished output carries: what a consumer needs
    to fetch the request's KV (vLLM's keys, and the layout's)."""
    return {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": engine_id, "remote_request_id": request_id,
            "remote_host": host, "remote_port": port, "remote_num_tokens": num_tokens,
            "remote_block_size": layout.block_size, "remote_kv_dtype": layout.dtype,
            "remote_page_shape": list(layout.page_shape), "tp_size": layout.tp_size,
            "remote_transport": transport, "remote_transfer_id": transfer_id}


def kv_transfer_params_of(extra_args: Mapping[str, Any] | None) -> Any:
    """A request's `kv_transfer_params` (vLLM carries them in `SamplingParams.extra_args`)."""
    return None if extra_args is None else extra_args.get("kv_transfer_params")
