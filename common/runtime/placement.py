"""Where each rank runs: its CPU cores, its GPU's NUMA node, and whether its DataLoader fits.

    placement = record_placement(ctx.device, args.num_workers)   # every rank; prints, gathers
    provenance(..., extra={"placement": placement})              # rank 0 puts it in the record

Two mistakes cost distributed jobs the most without any error message:

- **A rank's cores on the other socket from its GPU.** Every host-to-device copy then crosses the
  link between the sockets. Slurm places tasks near their GPUs with ``--gpu-bind=closest`` (or
  ``--gres-flags=enforce-binding``); ``nvidia-smi topo -m`` shows each GPU's "CPU Affinity" and
  "NUMA Affinity". Here the GPU's NUMA node is read from sysfs
  (``/sys/bus/pci/devices/<bus id>/numa_node``) and the cores' from
  ``/sys/devices/system/node/node<N>/cpulist``.
- **More DataLoader workers than cores.** Since Slurm 22.05 an ``srun`` step no longer inherits
  ``--cpus-per-task`` from ``sbatch``: without ``SRUN_CPUS_PER_TASK`` (``slurm/lib/job_header.sh``
  exports it) each task may be confined to one core, and its workers and the training loop fight
  over it.

:func:`check_placement` looks at this process (pure reads of ``os.sched_getaffinity`` and sysfs, so
tests point ``sysfs`` at a fake tree); :func:`record_placement` prints every rank's line tagged
``[host:rank]`` with a ``WARNING`` line per problem and returns all ranks' findings (it gathers:
every rank must call it).

Imports torch only to find a GPU's PCI bus id.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Iterable

__all__ = ["check_placement", "record_placement", "placement_lines", "gpu_pci_bus_id", "cpu_list",
           "parse_cpu_list", "numa_nodes", "gpu_numa_node", "SYSFS"]

SYSFS = Path("/sys")


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` (the kernel's cpulist format) as ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpu_list`: ``[0, 1, 2, 3, 8]`` as ``0-3,8``."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = previous = None
    for cpu in ordered + [None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(ranges)


def numa_nodes(sysfs: Path = SYSFS) -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from ``/sys/devices/system/node/node*/cpulist`` (empty if unknown)."""
    nodes = {}
    for folder in sorted((Path(sysfs) / "devices/system/node").glob("node[0-9]*")):
        try:
            nodes[int(folder.name[4:])] = set(parse_cpu_list((folder / "cpulist").read_text()))
        except (OSError, ValueError):
            continue
    return nodes


def gpu_numa_node(bus_id: str, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of the PCI device ``bus_id`` (``0000:3b:00.0``); ``None`` when the kernel does not say.

    sysfs writes -1 on machines with one NUMA node (and in many virtual machines).
    """
    try:
        node = int((Path(sysfs) / "bus/pci/devices" / bus_id.lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_pci_bus_id(device: Any) -> str:
    """PCI bus id of a CUDA device in sysfs's form, ``0000:3b:00.0`` (whatever CUDA_VISIBLE_DEVICES says)."""
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def check_placement(device: Any, num_workers: int | None, *, sysfs: Path = SYSFS, cpus: Iterable[int] | None = None,
                    bus_id: str | None = None, rank: int | None = None) -> dict[str, Any]:
    """This process's placement and what is wrong with it (``warnings``), as a dict for the record."""
    from common.runtime.launch import detect_launch

    rank = detect_launch().rank if rank is None else rank
    owned = set(_affinity() if cpus is None else cpus)
    nodes = numa_nodes(sysfs)
    cpu_nodes = sorted(node for node, node_cpus in nodes.items() if owned & node_cpus)
    host = socket.gethostname()
    info: dict[str, Any] = {
        # Slurm's name for the node (what its node list says; emulated nodes share one host name).
        "host": host, "node": os.environ.get("SLURMD_NODENAME") or host, "rank": rank,
        "cpus": cpu_list(owned), "cpu_count": len(owned),
        "cpu_numa_nodes": cpu_nodes or None, "device": str(device), "gpu_bus_id": None, "gpu_numa_node": None,
        "cpus_on_gpu_numa_node": None, "numa_match": None, "num_workers": num_workers, "warnings": [],
    }
    if getattr(device, "type", str(device).split(":")[0]) == "cuda":
        bus = bus_id or gpu_pci_bus_id(device)
        gpu_node = gpu_numa_node(bus, sysfs)
        info.update(gpu_bus_id=bus, gpu_numa_node=gpu_node)
        if gpu_node is not None and gpu_node in nodes:
            near = len(owned & nodes[gpu_node])
            info.update(cpus_on_gpu_numa_node=near, numa_match=near == len(owned))
            if near == 0:
                info["warnings"].append(
                    f"all {len(owned)} of this rank's cores ({cpu_list(owned)}) are on NUMA node(s) "
                    f"{','.join(map(str, cpu_nodes))}, its GPU {bus} on node {gpu_node}: every copy to the GPU "
                    "crosses sockets (srun --gpu-bind=closest, or ask for cores with the GPU)")
            elif near < len(owned):
                info["warnings"].append(
                    f"only {near} of this rank's {len(owned)} cores are on its GPU's NUMA node {gpu_node} "
                    "(srun --gpu-bind=closest)")
    if num_workers is not None and len(owned) < num_workers:
        info["warnings"].append(
            f"{num_workers} DataLoader workers but this rank owns {len(owned)} core(s) ({cpu_list(owned)}): they "
            "take turns with the training loop; lower --num-workers, or under Slurm ask for --cpus-per-task "
            "and export SRUN_CPUS_PER_TASK so srun steps get them")
    return info


def placement_lines(info: dict[str, Any]) -> list[str]:
    """What :func:`record_placement` prints for one rank."""
    numa = f", NUMA {','.join(map(str, info['cpu_numa_nodes']))}" if info["cpu_numa_nodes"] else ""
    line = f"placement: cores {info['cpus']} ({info['cpu_count']}{numa})"
    if info["gpu_bus_id"]:
        node = info["gpu_numa_node"]
        where = "NUMA node unknown" if node is None else f"NUMA {node}"
        match = "" if info["numa_match"] is None else (": same node" if info["numa_match"] else ": MISMATCH")
        line += f" | GPU {info['device']} {info['gpu_bus_id']} {where}{match}"
    else:
        line += f" | {info['device']}"
    if info["num_workers"] is not None:
        line += f" | DataLoader workers {info['num_workers']}"
    return [line, *(f"WARNING placement: {warning}" for warning in info["warnings"])]


def record_placement(device: Any, num_workers: int | None, **kwargs: Any) -> list[dict[str, Any]]:
    """Check, print (every rank, tagged ``[host:rank]``) and gather every rank's placement, in rank order.

    Collective when a process group exists: every rank must call it. Returns the same list on every rank.
    """
    from common.runtime.distributed import gather_objects, print_rank

    info = check_placement(device, num_workers, **kwargs)
    for line in placement_lines(info):
        print_rank(line)
    return gather_objects(info)
