"""The CPUs this process may use, and what follows from them: DataLoader workers and threads.

On a cluster the allocation decides, not the node: ``SLURM_CPUS_PER_TASK`` says how many CPUs the
task was given, and the affinity mask (which Slurm's cgroups narrow) says which ones this process
may run on. :func:`common.runtime.device.configure_threads` sizes PyTorch's thread pool from
:func:`allocated_cpus`, :func:`common.cli.add_common_args` the default of ``--num-workers`` from
:func:`default_num_workers`, and the environment check reports :func:`usable_cpus`.

This module must not import torch.
"""

from __future__ import annotations

import os

__all__ = ["usable_cpus", "allocated_cpus", "default_num_workers"]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which Slurm's cgroups narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def allocated_cpus(env: dict[str, str] | None = None) -> int | None:
    """``SLURM_CPUS_PER_TASK``, capped at the CPUs we can really use; ``None`` off-cluster.

    The cap matters where Slurm does not confine tasks (no cgroups, or a test cluster that claims
    more CPUs than the machine has): 16 threads on 2 cores would only slow things down.
    """
    env = dict(os.environ) if env is None else env
    cpus = env.get("SLURM_CPUS_PER_TASK", "")
    if cpus.isdigit() and int(cpus) > 0:
        return min(int(cpus), usable_cpus())
    return None


def default_num_workers(env: dict[str, str] | None = None) -> int:
    """DataLoader workers from the allocation: one fewer than this process's share of its CPUs (one core
    trains), else 2.

    The main process needs a core of its own to drive the training loop; the rest feed it. The processes
    torchrun starts in one Slurm task (``LOCAL_WORLD_SIZE``) share that task's CPUs; srun's tasks have their own.
    Off-cluster we use 2, which suits a laptop and CI.
    """
    env = dict(os.environ) if env is None else env
    cpus = allocated_cpus(env)
    if cpus is None:
        return 2
    local = env.get("LOCAL_WORLD_SIZE", "")
    processes = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(0, cpus // processes - 1)
