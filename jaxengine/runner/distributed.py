"""Multi-host: joining JAX's multi-controller runtime, and reading results every process holds.

JAX scales past one host by running the same program on every host (one process each), all
joined by `jax.distributed.initialize`; `jax.devices()` then lists every host's devices and
one mesh spans them. `initialize_from_args` joins from the engine arguments
`coordinator_address`, `num_processes` and `process_id`, or lets JAX detect them (Cloud TPU
pods, SLURM, Open MPI, Kubernetes). It must run before anything starts a JAX backend in the
process (a computation, `jax.devices()`, `jax.device_put`, ...): `LLM(...)` and
`jaxengine serve` call it first thing; a script that touches JAX before building its `LLM`
calls it itself.

After a step the sampled tokens are replicated arrays whose devices are partly on other hosts;
`to_host` reads them on every process (jax refuses a plain `device_get` of such an array).
`process_allgather` and `broadcast_one_to_all` are the few collectives the host side runs
itself (jax.experimental.multihost_utils has both, but returns once the first local device has
its copy: see `_across_processes`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:  # at run time only its instances arrive; the runner imports this module
    from jaxengine.engine.args import EngineArgs

logger = logging.getLogger("jaxengine.distributed")

DISTRIBUTED_FIELDS = ("coordinator_address", "num_processes", "process_id")
# Engine arguments that may differ between processes: each host's own index, and the model
# path (a host may mount the same checkpoint elsewhere).
PER_PROCESS_FIELDS = ("process_id", "model")


def initialize_from_args(args: EngineArgs) -> None:
    """Join the multi-controller runtime as `args` say; on a plain single machine, do nothing.

    Any of `coordinator_address`, `num_processes`, `process_id` given: call
    `jax.distributed.initialize` with them (JAX detects the ones left None where it can). None
    given: call it with no arguments if JAX's cluster detection finds a multi-process job,
    else do nothing. Already initialized (by an earlier `LLM`, or by the caller): only check
    that `args` agree. With more than one process, every process's engine arguments must be the
    same, except `PER_PROCESS_FIELDS`; that is checked here too (a mismatch would deadlock in
    the first collective).

    Raises:
      ValueError: a JAX backend already started (call this earlier), JAX could not start from
        what was given, `args` disagree with the running runtime, or the processes' engine
        arguments differ.
    """
    given = {name: getattr(args, name) for name in DISTRIBUTED_FIELDS}
    if jax.distributed.is_initialized():
        _check_agrees(args)
    elif any(v is not None for v in given.values()):
        _initialize(given)
    elif (cluster := _detected_cluster()) is not None:
        logger.info("multi-host: %s detected; jax.distributed.initialize()", cluster)
        _initialize({})
    else:
        return
    if jax.process_count() > 1:
        check_same_args(args)
        logger.info("multi-host: process %d of %d, %d local of %d devices", jax.process_index(),
                    jax.process_count(), jax.local_device_count(), jax.device_count())


def _initialize(kwargs: dict[str, Any]) -> None:
    given = {k: v for k, v in kwargs.items() if v is not None}
    try:
        jax.distributed.initialize(**given)
    except RuntimeError as e:  # jax: "must be called before any JAX calls that ..."
        raise ValueError(
            f"multi-host setup ({_flags(given)}) came too late: {e} Build the LLM (or call "
            f"jaxengine.initialize_from_args) before any other JAX call.") from e
    except ValueError as e:  # jax: "coordinator_address should be defined." and the like
        raise ValueError(
            f"jax.distributed.initialize could not start from {_flags(given) or 'nothing'}: "
            f"{e} Give all three of --coordinator-address HOST:PORT (process 0's), "
            f"--num-processes N and --process-id I, or run where JAX detects them (Cloud TPU, "
            f"SLURM, Open MPI, Kubernetes).") from e


def _flags(given: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in given.items())


def _check_agrees(args: EngineArgs) -> None:
    """The runtime is up already: `args` may only repeat what it has."""
    actual = {"num_processes": jax.process_count(), "process_id": jax.process_index()}
    for name, value in actual.items():
        if getattr(args, name) not in (None, value):
            raise ValueError(f"jax.distributed is already initialized with {name}={value}, but "
                             f"the engine arguments say {getattr(args, name)}; leave {name} "
                             f"unset or make them agree")


def _detected_cluster() -> str | None:
    """The name of the multi-process job JAX's `initialize()` would join, if any.

    jax has no public way to ask, so this walks its cluster registry (`jax._src.clusters`,
    pinned jax 0.12) the way `initialize()` does, skipping opt-in methods (mpi4py) as it does.
    A one-process job is no multi-host job: nothing to join. Neither is an environment JAX
    cannot bootstrap from (Kubernetes without the `kubernetes` package, where jax warns, or
    a cluster API that fails): this runs on every single-machine start, so it stays quiet.
    """
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not env.is_env_present():
                    continue
                count = env.get_process_count()
        except Exception as e:  # any failure of a cluster's own probe: not a job to join
            logger.debug("multi-host: %s present but unusable: %s", env.__name__, e)
            continue
        return env.__name__ if count > 1 else None
    return None


def check_same_args(args: EngineArgs) -> None:
    """Every process must run with the same engine arguments (but `PER_PROCESS_FIELDS`).

    Raises:
      ValueError (on every process): they differ; the message lists each process's digest.
    """
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
              if f.name not in PER_PROCESS_FIELDS}
    digest = np.frombuffer(hashlib.sha256(repr(sorted(shared.items())).encode()).digest()[:8],
                           np.uint8)
    everyone = process_allgather(digest)  # u8[processes, 8]
    if (everyone != everyone[0]).any():
        digests = ", ".join(f"process {i}: {d.tobytes().hex()}" for i, d in enumerate(everyone))
        raise ValueError(f"the processes were started with different engine arguments "
                         f"({digests}); run the same command on every host, changing only "
                         f"--process-id (and --headless)")


def to_host(tree: Any) -> Any:
    """`jax.device_get` that also works in multi-host, where arrays span processes.

    With one process it is `jax.device_get`. With several, every process must call it at the
    same point, as lockstep serving does, because it may communicate; what each array needs
    depends only on its sharding, the same on every process (never on what this process
    happens to hold): a replicated array on devices of every process is read from this
    process's own copy; a replicated one on some processes' devices only (an engine on one
    host) is broadcast from the first of them; a sharded one on every process's devices is
    gathered (replicated by a program, then read as the first case).

    Raises:
      ValueError: a sharded array that leaves some processes out (nothing gathers it), or
        one sharded without a mesh.
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)  # one batched transfer
    return jax.tree.map(_leaf_to_host, tree)


def _leaf_to_host(x: Any) -> np.ndarray:
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    holders = {d.process_index for d in x.sharding.device_set}
    everywhere = len(holders) == jax.process_count()
    if x.sharding.is_fully_replicated and everywhere:
        return np.asarray(x.addressable_data(0))
    if x.sharding.is_fully_replicated:
        source = jax.process_index() == min(holders)
        local = np.asarray(x.addressable_data(0)) if source else np.zeros(x.shape, x.dtype)
        return broadcast_one_to_all(local, is_source=source)
    if not everywhere:
        raise ValueError(f"cannot read an array sharded over the devices of processes "
                         f"{sorted(holders)} only ({x.sharding}); replicate it first")
    if not isinstance(x.sharding, NamedSharding):
        raise ValueError(f"cannot read a sharded array without a mesh ({x.sharding}); "
                         f"shard it with a NamedSharding")
    replicated = jax.jit(_same, out_shardings=x.sharding.update(spec=PartitionSpec()))(x)
    return np.asarray(replicated.addressable_data(0))


def process_allgather(x: np.ndarray) -> np.ndarray:
    """[processes, *x.shape]: every process's `x`, in process order. A collective: every
    process calls it at the same point."""
    return _across_processes(_same, np.asarray(x))


def broadcast_one_to_all(x: np.ndarray, *, is_source: bool) -> np.ndarray:
    """The source process's `x` on every process (exactly one process is the source; the
    others pass an array of the same shape and dtype). A collective, as `process_allgather`."""
    x = np.asarray(x)
    return _across_processes(_sum, x if is_source else np.zeros_like(x))


def _across_processes(fn: Any, x: np.ndarray) -> np.ndarray:
    """`fn` over the processes' `x` stacked by process index ([processes, *x.shape] in,
    replicated out), read on this process once every local device has the result. A process
    that read only its first device's copy and then exited could leave its other devices
    inside the collective, waiting for processes that have left: the CPU client's destructor
    then waits on them forever (seen with two processes refused by `check_same_args`)."""
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count()),
                ("processes", "local_devices"))
    rows = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("processes")), x[None],
        (jax.process_count(), *x.shape))
    out = jax.jit(fn, out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
    return np.asarray(out.block_until_ready().addressable_data(0))


def _same(x: jax.Array) -> jax.Array:
    return x


def _sum(x: jax.Array) -> jax.Array:  # [processes, ...] -> [...]
    return jnp.sum(x, axis=0, dtype=x.dtype)
