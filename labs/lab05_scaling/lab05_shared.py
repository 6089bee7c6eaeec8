"""What Lab-05's scripts share: message sizes, the bus-bandwidth formulas, what NCCL says it used,
the link's peak from the site profile, the memory-copy reference, and the scaling points.

The lessons stay in the scripts (``01_allreduce_bench.py`` times the collectives,
``02_scaling_study.py`` launches the training, ``03_overlap.py`` times DDP's steps); this module holds
the arithmetic and the parsing, so that each piece is unit-tested on its own (``tests/test_lab05.py``).
Nothing here imports torch at import time.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from common.runtime.cpus import usable_cpus
from common.errors import UserError
from common.slurm.sites import Link, find_site
from common.units import format_bytes

LAB = "lab05"
REPO = Path(__file__).resolve().parents[2]

KiB, MiB, GiB = 1024, 1024**2, 1024**3
#: Smallest message the benchmark times, and the largest it allows on each device.
MIN_BYTES = KiB
MAX_BYTES = {"cpu": 64 * MiB, "cuda": 16 * GiB}
#: Bytes per element of the float32 buffers the benchmark moves.
ELEMENT_BYTES = 4
#: GB/s as network and link datasheets count them: 10**9 bytes per second (nccl-tests does the same).
GB = 1e9

# --------------------------------------------------------------------------------------------
# Message sizes

_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB}


def parse_size(text: str) -> int:
    """``4096``, ``1K``, ``64M``, ``1GiB`` -> bytes (binary units, as message sizes are usually given)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 1K, 64M, 1G)")
    return int(float(match["number"]) * _UNITS[match["unit"].upper()])


def message_sizes(min_bytes: int, max_bytes: int, factor: int, device_type: str) -> list[int]:
    """``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` (included), checked against the device's range."""
    limit = MAX_BYTES["cuda" if device_type == "cuda" else "cpu"]
    if min_bytes < MIN_BYTES:
        raise UserError(f"--min-bytes {format_bytes(min_bytes)} is below the smallest size timed, "
                        f"{format_bytes(MIN_BYTES)}")
    if max_bytes < min_bytes:
        raise UserError(f"--max-bytes {format_bytes(max_bytes)} is below --min-bytes {format_bytes(min_bytes)}")
    if max_bytes > limit:
        why = ("Gloo copies every message through host memory and the run would take minutes; use a GPU for "
               "larger messages" if device_type != "cuda" else "larger buffers do not fit beside NCCL's own")
        raise UserError(f"--max-bytes {format_bytes(max_bytes)} is above the {device_type} limit of "
                        f"{format_bytes(limit)} ({why})")
    if factor < 2:
        raise UserError(f"--step-factor must be at least 2, got {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# --------------------------------------------------------------------------------------------
# Bus bandwidth, as NVIDIA's nccl-tests define it (their performance notes)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(collective: str, ranks: int) -> float:
    """busbw / algbw for ``collective`` over ``ranks`` processes.

    All-reduce moves every element 2(n-1) times over n links (n-1 additions, n-1 copies of the
    result): 2(n-1)/n. All-gather and reduce-scatter do one half of that: (n-1)/n. With those
    factors busbw is independent of n and compares with one link's peak. One rank moves nothing: 0.
    """
    if collective not in COLLECTIVES:
        raise UserError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    share = (ranks - 1) / ranks
    return 2 * share if collective == "all_reduce" else share


def bandwidths(collective: str, size_bytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (10**9 B/s) of one operation on ``size_bytes`` taking ``seconds``.

    ``size_bytes`` is nccl-tests' S: the whole array (all-reduce: each rank's buffer; all-gather:
    the gathered output; reduce-scatter: the input that is scattered). ``algbw = S / t``.
    """
    algbw = size_bytes / seconds / GB
    return algbw, algbw * bus_factor(collective, ranks)


def parse_collectives(text: str) -> list[str]:
    names = [name.strip().replace("-", "_") for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in COLLECTIVES]
    if unknown or not names:
        raise UserError(f"unknown collective {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(COLLECTIVES)}")
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------------------------
# What NCCL says it used: NCCL_DEBUG=INFO output

_CHANNEL = re.compile(r"Channel \d+(?:/\d+)?\s*:.*?\bvia (?P<via>\S+)")
_NETWORK = re.compile(r"Using network (?P<net>\S+)")
_PATTERN = re.compile(r"Pattern \d+, crossNic \d+, nChannels \d+.*?type (?P<intra>\w+)/(?P<inter>\w+)")


def nccl_debug_environment(folder: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables that make NCCL write what it chose into ``folder`` (one file per process), unless set."""
    env = os.environ if env is None else env
    if env.get("NCCL_DEBUG_FILE"):
        return {}
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH",
            "NCCL_DEBUG_FILE": str(folder / "nccl.%h.%p.log")}


def nccl_log_files(env: Mapping[str, str] | None = None) -> list[Path]:
    """This process's NCCL debug file(s): ``NCCL_DEBUG_FILE`` with ``%h`` (host) and ``%p`` (pid) filled in."""
    import socket

    env = os.environ if env is None else env
    pattern = env.get("NCCL_DEBUG_FILE")
    if not pattern:
        return []
    path = Path(pattern.replace("%h", socket.gethostname()).replace("%p", str(os.getpid())))
    return [path] if path.is_file() else []


def parse_nccl_log(lines: Iterable[str]) -> dict[str, Any]:
    """The transports (``P2P/...``, ``SHM``, ``NET/IB``, ``NET/Socket``, ``NVLS``), network and paths NCCL reports."""
    via: set[str] = set()
    networks: set[str] = set()
    paths: set[str] = set()
    for line in lines:
        if "NCCL INFO" not in line:
            continue
        if (match := _CHANNEL.search(line)) is not None:
            parts = match["via"].split("/")
            if parts[0] == "NET" and len(parts) > 1:  # NET/IB/0/GDRDMA, NET/IBext_v8/1 (a plugin), NET/Socket/0
                via.add("NET/IB" if parts[1].startswith("IB") else f"NET/{parts[1]}")
            else:
                via.add(parts[0])
        if "Connected NVLS" in line:
            via.add("NVLS")
        if (match := _NETWORK.search(line)) is not None:
            networks.add(match["net"])
        if (match := _PATTERN.search(line)) is not None:
            paths.update({match["intra"], match["inter"]})
    return {"via": sorted(via), "networks": sorted(networks), "paths": sorted(paths)}


def describe_nccl(found: Mapping[str, Any], nodes: int) -> tuple[str, str | None]:
    """One line on what NCCL used, and a warning when it is the slow path across nodes (or unknown)."""
    via, paths = set(found.get("via", ())), set(found.get("paths", ()))
    parts = []
    if "P2P" in via:
        kind = ("NVLink" if paths & {"NVL", "NVB", "C2C"} else
                "PCIe" if paths & {"PIX", "PXB", "PHB"} else "NVLink or PCIe")
        parts.append(f"{kind} peer-to-peer (P2P)")
    if "NVLS" in via:
        parts.append("NVLink SHARP (NVLS)")
    if "SHM" in via:
        parts.append("shared host memory (SHM: no peer-to-peer between these GPUs)")
    if "NET/IB" in via:
        parts.append("InfiniBand/RoCE (NET/IB)")
    if "NET/Socket" in via:
        parts.append("TCP sockets (NET/Socket)")
    others = sorted(v for v in via if v not in {"P2P", "NVLS", "SHM", "NET/IB", "NET/Socket"})
    parts += others
    if "SYS" in paths:
        parts.append("paths cross CPU sockets (SYS)")
    if not via:
        return ("unknown: NCCL printed no channel lines (NCCL_DEBUG_FILE was set elsewhere, or a single rank)",
                "NCCL's transport could not be read" if nodes > 1 else None)
    warning = None
    if nodes > 1 and "NET/Socket" in via:
        warning = ("NCCL moves data between nodes over TCP sockets (NET/Socket), not InfiniBand: expect a few GB/s. "
                   "Check that the job sees the InfiniBand devices (ibv_devinfo), NCCL_IB_DISABLE is unset, and "
                   "NCCL_SOCKET_IFNAME/NCCL_IB_HCA name the right interfaces")
    return "NCCL: " + "; ".join(parts), warning


def describe_gloo(hosts: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """Gloo (the CPU backend) has one transport in PyTorch's builds: TCP."""
    env = os.environ if env is None else env
    interface = env.get("GLOO_SOCKET_IFNAME")
    where = (f"TCP between {len(set(hosts))} hosts" if len(set(hosts)) > 1 else
             "TCP over the loopback interface (all ranks on one host)")
    named = f", interface {interface} (GLOO_SOCKET_IFNAME)" if interface else ""
    return f"Gloo: {where}{named}; every message is copied through host memory and the kernel's socket buffers"


# --------------------------------------------------------------------------------------------
# The peak a busbw is compared with

@dataclass(frozen=True)
class Reference:
    """What busbw is compared with: a link's datasheet peak or a measured memory-copy bandwidth."""

    kind: str  # "link" or "memcpy"
    name: str
    gb_per_s: float | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "gb_per_s": self.gb_per_s, "source": self.source}


def site_links(site: str, partition: str | None = None) -> dict[str, Link]:
    """The link peaks of a partition of a site profile (``slurm/sites/<site>.yaml``, its GPU partition
    by default); ``{}`` when the profile lists none."""
    profile = find_site(site)
    name = partition or profile.default_partitions["gpu"]
    if name not in profile.partitions:
        raise UserError(f"site {site} has no partition {name!r} (it has: {', '.join(profile.partitions)})")
    return dict(profile.partitions[name].links)


#: The link that bounds busbw, in order of preference: the GPUs' own link within one node; across
#: nodes, the node's network.
GPU_LINKS = ("nvlink", "pcie")
NODE_LINKS = ("infiniband", "slingshot", "ethernet")
LINK_NAMES = {"nvlink": "NVLink", "pcie": "PCIe", "infiniband": "InfiniBand", "slingshot": "Slingshot",
              "ethernet": "Ethernet"}


def link_reference(links: Mapping[str, Link], nodes: int, site: str) -> Reference | None:
    """The peak busbw is compared with: NVLink (else PCIe) per GPU within a node, the node's network across nodes."""
    for kind in NODE_LINKS if nodes > 1 else GPU_LINKS:
        link = links.get(kind)
        if link is not None:
            scope = "per node" if link.per == "node" else "per GPU"
            return Reference("link", f"{LINK_NAMES[kind]} ({scope}, one direction)", link.gb_per_s,
                             f"site profile {site}: {link.source}")
    return None


def measure_memcpy(size_bytes: int = 64 * MiB, repeats: int = 5) -> Reference:
    """This process's memory-copy bandwidth: ``dst.copy_(src)`` of a buffer larger than the caches.

    Bytes copied per second (each byte read once and written once; STREAM's "Copy" counts both, so
    it reports twice this), median of ``repeats`` after one warm-up copy, with this process's threads.
    """
    import torch

    src = torch.ones(size_bytes // ELEMENT_BYTES)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    times.sort()
    rate = size_bytes / times[len(times) // 2] / GB
    return Reference("memcpy", "memory copy of this machine (measured)", rate,
                     f"torch copy_ of {format_bytes(size_bytes)}, median of {repeats}, "
                     f"{torch.get_num_threads()} thread(s), rank 0 alone while the others waited")


# --------------------------------------------------------------------------------------------
# Scaling points

MODES = ("strong", "weak")


def parse_points(text: str) -> list[int]:
    try:
        points = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--processes takes whole numbers separated by commas, e.g. 1,2,4; got {text!r}") from None
    if not points or min(points) < 1:
        raise UserError(f"--processes needs process counts of at least 1, got {text!r}")
    return sorted(set(points))


def parse_modes(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise UserError(f"unknown scaling mode {', '.join(unknown) or '(none given)'}; choose strong, weak or both")
    return [mode for mode in MODES if mode in modes]


@dataclass(frozen=True)
class Allocation:
    """How many processes (and nodes) a scaling point may use here."""

    processes: int
    nodes: int
    per_node: int
    what: str  # in words, for the error message and the record


def _leading_int(text: str | None) -> int | None:
    match = re.match(r"\s*(\d+)", text or "")
    return int(match[1]) if match else None


def current_allocation(device_type: str, env: Mapping[str, str] | None = None, *, gpus: int = 0,
                       cpus: int | None = None) -> Allocation:
    """The Slurm allocation this runs in (tasks and nodes), else this machine: its GPUs, or its cores on CPU."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID") and _leading_int(env.get("SLURM_NTASKS")):
        nodes = _leading_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) or 1
        tasks = _leading_int(env.get("SLURM_NTASKS")) or 1
        per_node = (_leading_int(env.get("SLURM_NTASKS_PER_NODE")) or _leading_int(env.get("SLURM_TASKS_PER_NODE"))
                    or max(1, tasks // nodes))
        return Allocation(tasks, nodes, per_node, f"Slurm job {env['SLURM_JOB_ID']}: {tasks} task(s) on "
                                                  f"{nodes} node(s), {per_node} per node")
    if device_type == "cuda":
        return Allocation(gpus, 1, gpus, f"{gpus} GPU(s) visible on this machine")
    cores = usable_cpus() if cpus is None else cpus
    return Allocation(cores, 1, cores, f"{cores} CPU core(s) this process may use (one process per core)")


def nodes_for(processes: int, allocation: Allocation) -> int:
    return math.ceil(processes / allocation.per_node)


def check_points(points: Sequence[int], allocation: Allocation) -> None:
    """Every point fits the allocation, or one line naming the first that does not."""
    for processes in points:
        nodes = nodes_for(processes, allocation)
        if processes > allocation.processes or nodes > allocation.nodes:
            raise UserError(f"scaling point of {processes} processes is larger than the allocation "
                            f"({allocation.what}); drop it from --processes or ask for more")


def per_process_batch(mode: str, processes: int, batch_size: int, global_batch_size: int) -> int:
    """Strong scaling splits one global batch; weak scaling gives every process the same batch."""
    if mode == "weak":
        return batch_size
    if global_batch_size % processes:
        raise UserError(f"strong scaling splits the global batch {global_batch_size} over {processes} processes: "
                        "it must divide evenly; choose --global-batch-size accordingly")
    return global_batch_size // processes


def evaluations(metrics: Mapping[str, Any]) -> tuple[list[dict[str, float]], str]:
    """The run's validation accuracy over time: ``eval_history`` when the training recorded one.

    Without it (a training script that evaluates only at the end), the one point is the final test
    accuracy at the end of training (elapsed = the sum of the epochs' times, evaluation excluded).
    """
    history = metrics.get("eval_history")
    if isinstance(history, list) and history:
        points = [{"epoch": h.get("epoch"), "elapsed_s": float(h["elapsed_s"]), "accuracy": float(h["test_accuracy"])}
                  for h in history if isinstance(h, Mapping) and h.get("elapsed_s") is not None
                  and h.get("test_accuracy") is not None]
        if points:
            return points, "eval_history (per-epoch validation)"
    accuracy, epochs = metrics.get("test_accuracy"), metrics.get("epoch_time_s")
    if isinstance(accuracy, (int, float)) and isinstance(epochs, list) and epochs:
        return ([{"epoch": len(epochs), "elapsed_s": float(sum(epochs)), "accuracy": float(accuracy)}],
                "final evaluation only (the training recorded no per-epoch eval_history)")
    return [], "no validation accuracy recorded"


def time_to_target(points: Sequence[Mapping[str, float]], target: float) -> float | None:
    """Seconds until the validation accuracy first reached ``target``; ``None`` if it never did."""
    for point in sorted(points, key=lambda p: p["elapsed_s"]):
        if point["accuracy"] >= target:
            return point["elapsed_s"]
    return None
