"""KV pages device to device through `jax.experimental.transfer`: `DeviceTransferServer`.

Each engine of the "jax" transport runs one transfer server (a producer's listens on kv_ip /
kv_port, the address its handles name; a consumer's on any free port, only to connect from).
A producer offers a request's gathered pages once (`offer`, JAX's `await_pull`) under an
integer id its handle carries; a consumer pulls them (`pull`) straight into arrays on its own
devices, in the sharding it asks for, and scatters them into its pool there: no host copy on
either side.

What the API gives, and what we do about it (jax 0.12):
- The producer learns nothing when a pull is served. The server drops an offer once it is
  pulled (a second pull of the id is never served) or at the offer's deadline, so the
  producer's pages live outside the pool until one of the two.
- A pull returns at once; its arrays become ready when the pages have arrived, and never when
  the id is unknown, taken or expired or the producer is gone (a pull's own timeout does not
  end it). `pull` therefore waits for them only until its deadline and then gives up.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import jax
from jax.experimental import transfer

from jaxengine.kv_transfer.transport import TransferError

POLL_S = 0.002  # how often a pull looks whether its pages have arrived


class DeviceTransferServer:
    """One engine's `jax.experimental.transfer` server, on the devices of its pool."""

    def __init__(self, device: jax.Device, host: str, port: int) -> None:
        """Listen on (host, port) (port 0: any free one; `port` says which).

        Args:
          device: a device of the pool (its client runs the server).
        Raises:
          ValueError: the address cannot be bound (the message names kv_ip and kv_port).
        """
        try:
            self._server = transfer.start_transfer_server(device.client, f"{host}:{port}",
                                                          [f"{host}:0"])
        except Exception as e:  # noqa: BLE001 (jaxlib raises its own runtime errors)
            raise ValueError(f"kv_transfer_config: cannot start the jax transfer server on "
                             f"kv_ip={host!r} kv_port={port} ({e}); pick another kv_port (0: "
                             f"any free one)") from e
        self.host = host
        self.port = int(self._server.address().rsplit(":", 1)[1])

    def offer(self, transfer_id: int, pages: Sequence[jax.Array], *, timeout_s: float) -> None:
        """Offer `pages` for one pull under `transfer_id`, dropped after `timeout_s`."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self._server.await_pull(transfer_id, list(pages), timeout=deadline)

    def pull(self, host: str, port: int, transfer_id: int,
             pages: Sequence[jax.ShapeDtypeStruct], *, timeout_s: float) -> list[jax.Array]:
        """Pull the arrays a producer at (host, port) offered under `transfer_id`.

        Args:
          pages: each array's shape, dtype and sharding here (the offer's, in this pool's
            sharding).
        Returns:
          The arrays, on this engine's devices.
        Raises:
          TransferError: they did not arrive within `timeout_s` (the producer is gone, or the
            id is unknown, already pulled or expired) or arrived broken.
        """
        end = time.monotonic() + timeout_s
        try:
            arrays = self._server.connect(f"{host}:{port}").pull(transfer_id, list(pages))
            while not all(a.is_ready() for a in arrays):
                if time.monotonic() > end:
                    raise TransferError(f"the pages of transfer {transfer_id} from "
                                        f"{host}:{port} did not arrive within {timeout_s} s")
                time.sleep(POLL_S)
            return [a.block_until_ready() for a in arrays]
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 (jaxlib raises its own runtime errors)
            raise TransferError(f"pulling transfer {transfer_id} from {host}:{port} failed: "
                                f"{e}") from e
