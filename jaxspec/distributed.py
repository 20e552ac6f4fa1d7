"""Multi-host setup: `jax.distributed.initialize` from flags or environment, and fetching results.

The program is the same on one device and on a pod: every process runs the same Python, builds the
same global mesh (`jaxspec.sharding.make_mesh`), loads the model with `jaxspec.load(..., mesh=mesh)`
and calls `jaxspec.generate` with the same inputs; results are gathered to every process.

Settings, flag first, then environment:
  --coordinator-address / JAX_COORDINATOR_ADDRESS   host:port of process 0's coordinator
  --num-processes       / JAX_NUM_PROCESSES
  --process-id          / JAX_PROCESS_ID
With none of them set, `initialize_distributed(auto=True)` lets JAX detect the cluster (Cloud TPU pod
slices, SLURM, Open MPI...); `auto=False` (default) leaves a single process alone.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices_per_process: int | None = None,
    auto: bool = False,
) -> bool:
    """Call `jax.distributed.initialize` once, before any other JAX work. Returns True if this is a
    multi-process run.

    Args:
      coordinator_address, num_processes, process_id: explicit values; None reads JAX_COORDINATOR_ADDRESS,
        JAX_NUM_PROCESSES, JAX_PROCESS_ID.
      cpu_devices_per_process: CPU-only runs (tests, a laptop): this many host devices per process and
        gloo collectives across processes.
      auto: with no address configured, still initialize and let JAX detect the cluster.
    """
    import jax  # here, not at import: the CLIs add this module's flags before jax is needed (fast --help)

    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if cpu_devices_per_process is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices_per_process)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    configured = coordinator_address is not None or num_processes is not None or process_id is not None
    if not (configured or auto):
        return False
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    return jax.process_count() > 1


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """--coordinator-address, --num-processes, --process-id (defaults from the environment)."""
    group = parser.add_argument_group("multi-host (jax.distributed)")
    group.add_argument("--coordinator-address", default=None, help=f"host:port (default ${ENV_COORDINATOR})")
    group.add_argument("--num-processes", type=int, default=None, help=f"default ${ENV_NUM_PROCESSES}")
    group.add_argument("--process-id", type=int, default=None, help=f"default ${ENV_PROCESS_ID}")


def initialize_from_args(args: argparse.Namespace, **kwargs: Any) -> bool:
    """`initialize_distributed` with the values of `add_distributed_flags`."""
    return initialize_distributed(args.coordinator_address, args.num_processes, args.process_id, **kwargs)


def to_host(tree: Any) -> Any:
    """Device arrays -> numpy, also for global arrays spread over several processes (every process
    gets the full value; all processes must call this together)."""
    import jax

    def fetch(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(fetch, tree)


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op with one process). `name` must be the
    same on every process and unique per call site and round (e.g. "features/commit/3")."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
