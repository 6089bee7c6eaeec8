"""What Lab-05's scripts share: message sizes, the bus-bandwidth formulas, what NCCL says it used,
the link's peak from the site profile, the memory-copy reference, and the scaling points; and each
script's flags, tables and records.

The lessons stay in the scripts (``01_allreduce_bench.py`` times the collectives,
``02_scaling_study.py`` launches the training, ``03_overlap.py`` times DDP's steps); this module holds
the arithmetic, the parsing and the plumbing, so that each piece is unit-tested on its own
(``tests/test_lab05.py``). Nothing here imports torch at import time.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from common.cli import (add_common_args, add_former_names, add_lr_arg, add_run_args, add_timing_args, apply_dry_run,
                        config_dict, flags_given, non_negative_int, positive_float, positive_int)
from common.measure.energy import not_measured
from common.results import make_record, provenance, write_record
from common.runtime.cpus import usable_cpus
from common.errors import FlagError, UserError
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
        raise FlagError(f"--min-bytes {format_bytes(min_bytes)} is below the smallest size timed, "
                        f"{format_bytes(MIN_BYTES)}")
    if max_bytes < min_bytes:
        raise FlagError(f"--max-bytes {format_bytes(max_bytes)} is below --min-bytes {format_bytes(min_bytes)}")
    if max_bytes > limit:
        why = ("Gloo copies every message through host memory and the run would take minutes; use a GPU for "
               "larger messages" if device_type != "cuda" else "larger buffers do not fit beside NCCL's own")
        raise FlagError(f"--max-bytes {format_bytes(max_bytes)} is above the {device_type} limit of "
                        f"{format_bytes(limit)} ({why})")
    if factor < 2:
        raise FlagError(f"--step-factor must be at least 2, got {factor}")
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
        raise FlagError(f"unknown collective {', '.join(unknown) or '(none given)'}; "
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
            "NCCL_DEBUG_FILE": str(folder / "nccl.%p.log")}


def nccl_log_files(env: Mapping[str, str] | None = None) -> list[Path]:
    """This process's NCCL debug file(s): ``NCCL_DEBUG_FILE`` with ``%h`` (host) and ``%p`` (pid) filled in as NCCL
    fills them: the host name up to its first dot (``node01``, not ``node01.cluster.local``)."""
    import socket

    env = os.environ if env is None else env
    pattern = env.get("NCCL_DEBUG_FILE")
    if not pattern:
        return []
    path = Path(pattern.replace("%h", socket.gethostname().split(".")[0]).replace("%p", str(os.getpid())))
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
# 01_allreduce_bench.py: flags, checks, the table, what NCCL used, the record

BENCH_SCRIPT = "labs/lab05_scaling/01_allreduce_bench.py"


def add_bandwidth_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``01_allreduce_bench.py``: what to measure, what to compare with, then the common ones."""
    group = parser.add_argument_group("what to measure")
    group.add_argument("--collectives", default="all_reduce,all_gather,reduce_scatter",
                       help="comma-separated: all_reduce, all_gather, reduce_scatter (default: %(default)s)")
    group.add_argument("--min-bytes", type=size_arg, default="1K",
                       help="smallest message (S, the whole array), e.g. 1K (default: %(default)s)")
    group.add_argument("--max-bytes", type=size_arg, default=None,
                       help="largest message, e.g. 1G; at most 64M on CPU, 16G on GPU (default: 1G on GPU, "
                            "64M on CPU)")
    group.add_argument("--step-factor", type=positive_int, default=2,
                       help="each size is the previous one times this (default: %(default)s)")
    add_timing_args(group, warmup=5, repeats=20, what="calls per message size", former=("--iters",))
    group = parser.add_argument_group("what to compare with")
    group.add_argument("--site", default=None,
                       help="site profile (slurm/sites/NAME.yaml) whose link peaks busbw is compared with; "
                            "from HPC_DL_LABS_SITE in rendered jobs (default: none)")
    group.add_argument("--partition", default=None,
                       help="partition of --site (default: SLURM_JOB_PARTITION, else the site's GPU partition)")
    group.add_argument("--peak-gbps", type=positive_float, default=None,
                       help="compare with this peak instead, in GB/s one direction (default: from --site)")
    group.add_argument("--peak-source", default="given on the command line",
                       help="where the --peak-gbps figure comes from (default: %(default)s)")
    group.add_argument("--memcpy-repeats", type=positive_int, default=5,
                       help="copies timed for the CPU reference (default: %(default)s)")
    add_run_args(parser, dry_run="three message sizes up to 16 KiB, three timed calls each: checks that everything "
                                 "runs")  # no training, no data set: none of the training flags
    return parser


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def checked_sizes(args: argparse.Namespace, device_type: str) -> list[int]:
    """The message sizes to time (``--dry-run``: three small ones, fewer calls); ``--site`` and ``--partition``
    from the job (``HPC_DL_LABS_SITE``, ``SLURM_JOB_PARTITION``) when not given, checked before any work."""
    max_bytes = args.max_bytes or (1024**3 if device_type == "cuda" else 64 * 1024**2)
    if args.dry_run:  # seconds: three small sizes, one warm-up and three timed calls each
        max_bytes, args.repeats, args.warmup = min(max_bytes, 16 * 1024), min(args.repeats, 3), 1
        args.min_bytes = min(args.min_bytes, max_bytes)
    sizes = message_sizes(args.min_bytes, max_bytes, args.step_factor, device_type)
    args.site = args.site or os.environ.get("HPC_DL_LABS_SITE") or None
    if args.partition is not None and args.site is None:  # the flag's own value would be ignored
        raise FlagError(f"--partition {args.partition} is a partition of a site profile: give --site too "
                        "(the link peaks come from slurm/sites/SITE.yaml)")
    args.partition = args.partition or os.environ.get("SLURM_JOB_PARTITION") or None
    if args.site is not None:
        site_links(args.site, args.partition)  # an unknown site or partition: one line, before any work
    return sizes


def check_gpu_memory(largest: int, device: Any) -> None:
    """One error line when the largest message will not fit in the GPU's free memory."""
    if device.type != "cuda":
        return
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    if 2.5 * largest > free:  # the input, the output (all-gather: S), the expected result, NCCL's buffers
        raise UserError(f"--max-bytes {format_bytes(largest)} needs about {format_bytes(2.5 * largest)} of GPU "
                        f"memory; {format_bytes(free)} is free on {device}")


TABLE_HEADER = f"{'size':>10} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11} {'% ref':>7} {'ok':>3}"


def table_row(row: Mapping[str, Any]) -> str:
    """One message size of the bandwidth table (under :data:`TABLE_HEADER`)."""
    pct = row["busbw_pct_of_reference"]
    return (f"{format_bytes(row['bytes']):>10} {1e6 * row['time_s']:>11.1f} {row['algbw_gbps']:>11.3f} "
            f"{row['busbw_gbps']:>11.3f} {'' if pct is None else f'{pct:.1f}':>7} "
            f"{'yes' if row['correct'] else 'NO':>3}")


def nccl_found() -> dict[str, Any]:
    """What NCCL says this process used, from its debug file (:func:`nccl_log_files`)."""
    return parse_nccl_log(line for path in nccl_log_files() for line in path.read_text(errors="replace").splitlines())


def describe_transport(backend: str, hosts: Sequence[str], found: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The transport of the job: Gloo's in words, or what NCCL told every rank (``found``, one per rank) merged."""
    if backend != "nccl":
        return {"backend": backend, "summary": describe_gloo(hosts), "warning": None, "nccl": None}
    merged: dict[str, Any] = {"via": set(), "networks": set(), "paths": set()}
    for rank_found in found:
        for key in merged:
            merged[key].update(rank_found[key])
    merged = {key: sorted(values) for key, values in merged.items()}
    summary, warning = describe_nccl(merged, len(set(hosts)))
    return {"backend": backend, "summary": summary, "warning": warning, "nccl": merged}


def write_bandwidth_record(args: argparse.Namespace, ctx: Any, collective: str, results: list[dict[str, Any]], *,
                           reference: Reference | None, transport: dict[str, Any], energy: dict[str, Any],
                           placement: list[dict[str, Any]], collectives: list[str], threads: int) -> Path:
    """Print the transport, write the collective's record (rank 0), print its path."""
    print(f"transport: {transport['summary']}", flush=True)
    if transport["warning"]:
        print(f"WARNING: {transport['warning']}", flush=True)
    best = max(results, key=lambda r: r["busbw_gbps"])
    notes = [] if all(r["correct"] for r in results) else ["some sizes gave a wrong result (correct: false)"]
    if transport["warning"]:
        notes.append(transport["warning"])
    metrics = {
        "collective": collective, "world_size": ctx.world_size, "nodes": len(set(e["node"] for e in placement)),
        "bus_factor": bus_factor(collective, ctx.world_size), "sizes": results,
        "peak_busbw_gbps": best["busbw_gbps"], "peak_busbw_bytes": best["bytes"],
        "reference": None if reference is None else reference.as_dict(), "transport": transport,
        "timing_method": ("time.perf_counter around each call, device synchronised before each clock read, ranks "
                          "at a barrier before each call; per call the slowest rank's time; median over the timed "
                          "calls"),
    }
    config = config_dict(args, resolved_device=str(ctx.device), collectives=collectives,
                         sizes=[r["bytes"] for r in results], dtype="float32", threads=threads)
    record = make_record(lab=LAB, script=BENCH_SCRIPT, method=collective, config=config, metrics=metrics,
                         notes=notes, energy=energy,
                         provenance=provenance(ctx.device, ctx.world_size, {"distributed": ctx.describe(),
                                                                            "placement": placement}))
    path = write_record(record, args.results_dir)
    print(f"record: {path}", flush=True)
    return path


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
    """``--modes``: ``strong``, ``weak``, both as a comma list, or ``both``; in the order of :data:`MODES`."""
    modes = [part for mode in text.split(",") if mode.strip()
             for part in (MODES if mode.strip() == "both" else [mode.strip()])]
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


def check_training_input(training: Any, flags: argparse.Namespace) -> None:
    """Load the data set and build the model every point's ``training`` (the module) would, from its parsed ``flags``,
    once before any point runs: an unknown model, a data set missing from ``--data-dir`` or a model that cannot take
    the images is one line, not a failed record per point. The model is built on the meta device (no memory)."""
    import torch

    splits = training.lab_data(flags)
    with torch.device("meta"):
        training.build_model(flags.model, splits.num_classes, splits.input_shape[0])


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


# --------------------------------------------------------------------------------------------
# 02_scaling_study.py: flags, the record of a point

STUDY_SCRIPT = "labs/lab05_scaling/02_scaling_study.py"
#: The training every point runs: Lab-01's DDP script, which students already know. The study runs it
#: as a process (as a student would) and reads only its parser, by module name (a name starting with a
#: digit cannot be written in an import statement).
TRAINING = "labs/lab01_dp_vs_ddp/04_ddp_training.py"
TRAINING_MODULE = "labs.lab01_dp_vs_ddp.04_ddp_training"


#: The training's flags the study writes for every point: its own flags of the same names, then each point's batch
#: and the scratch folder it reads the point's record back from.
STUDY_SETS = ("device", "seed", "epochs", "model", "dataset", "image_size", "data_dir", "num_workers", "max_steps",
              "dry_run")
POINT_SETS = ("batch_size", "results_dir", "checkpoint")


def refuse_study_flags(training: argparse.ArgumentParser, training_args: Sequence[str]) -> None:
    """A flag after ``--`` that the study sets itself came last and won: the point trained with it while the study's
    record said the study's value (``-- --results-dir X`` also hid the point's record from the study). One line."""
    for dest, flag in flags_given(training, training_args, STUDY_SETS + POINT_SETS).items():
        why = {"batch_size": "the study sets each point's batch; give --batch-size (weak scaling, per process) or "
                             "--global-batch-size (strong scaling) before --",
               "results_dir": "each point writes its record to a scratch folder the study reads back; the study's "
                              "own --results-dir (before --) says where its records go",
               "checkpoint": "each point writes its checkpoint to a scratch folder the study removes"}
        raise UserError(f"{flag} after --: " + why.get(dest, f"the study passes its own {flag} to every point; "
                                                                 "give it before --"))


def fraction(text: str) -> float:
    """argparse type: an accuracy, a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"an accuracy is a fraction from 0 to 1 (0.9 for 90%), got {text}")
    return value


def add_study_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``02_scaling_study.py``: the study, the training it passes on, then the common ones;
    after ``--``, more flags for the training."""
    group = parser.add_argument_group("the study")
    group.add_argument("--processes", default="1,2,4",
                       help="process counts to run, comma-separated (default: %(default)s)")
    group.add_argument("--modes", default="strong,weak", help="strong, weak or both (default: %(default)s)")
    group.add_argument("--global-batch-size", type=positive_int, default=None,
                       help="strong scaling's global batch, split over the processes (default: --batch-size, so "
                            "the 1-process run is shared by both modes)")
    group.add_argument("--target-accuracy", type=fraction, default=0.9,
                       help="validation accuracy whose first arrival is timed (default: %(default)s)")
    group.add_argument("--point", type=non_negative_int, default=None,
                       help="run only the point with this index in --processes, e.g. $SLURM_ARRAY_TASK_ID "
                            "(default: every point)")
    group.add_argument("--launcher", choices=("auto", "torchrun", "srun"), default="auto",
                       help="auto: srun inside a Slurm job, else torchrun (default: %(default)s)")
    group = parser.add_argument_group("the training (passed to 04_ddp_training.py; more after --)")
    group.add_argument("--model", default="plain_cnn", help="model (default: %(default)s)")
    group.add_argument("--dataset", default="digits",
                       help="data set; digits is real and offline (default: %(default)s)")
    group.add_argument("--image-size", type=positive_int, default=16,
                       help="side of the images (digits are resized to it) (default: %(default)s)")
    add_common_args(parser, epochs=3, batch_size=32, num_workers=0)
    parser.add_argument("training_args", nargs=argparse.REMAINDER,
                        help="after --: more flags for the training, e.g. -- --lr 0.1 --warmup-steps 1")
    return parser


def point_record(mode: str, processes: int, nodes: int, batch: int, training: dict[str, Any] | None,
                 command: list[str], args: argparse.Namespace, study: dict[str, Any], notes: list[str],
                 status: str = "ok") -> dict[str, Any]:
    """The lab05 record of one point, built from the training's own record (or its failure)."""
    metrics_in = training["metrics"] if training else {}
    points, source = evaluations(metrics_in)
    reached = time_to_target(points, args.target_accuracy)
    keep = ("samples_per_s", "step_time", "time_per_epoch_s", "epoch_time_s", "final_loss", "train_loss",
            "test_loss", "test_accuracy", "memory", "steps", "epochs", "loss_at_step")
    metrics = {key: metrics_in.get(key) for key in keep if key in metrics_in}
    metrics.update({"world_size": processes, "nodes": nodes, "per_process_batch_size": batch,
                    "global_batch_size": batch * processes, "evaluations": points, "evaluations_source": source,
                    "target_accuracy": args.target_accuracy, "time_to_target_s": reached,
                    "training_run_id": training.get("run_id") if training else None})
    training_config = training["config"] if training else {}
    config = {"mode": mode, "processes": processes, "nodes": nodes, "per_process_batch_size": batch,
              "global_batch_size": batch * processes, "batch_size": args.batch_size,
              "strong_global_batch_size": args.global_batch_size, "target_accuracy": args.target_accuracy,
              "model": training_config.get("model", args.model),
              "dataset": training_config.get("dataset", args.dataset),
              "training_script": TRAINING, "training_command": command, "training_config": training_config,
              "study": study}
    prov = dict(training["provenance"]) if training else provenance()
    prov["scaling_study"] = {"command": [sys.executable, *sys.argv], "study_id": study["id"]}
    energy = training.get("energy") if training else None
    return make_record(lab=LAB, script=STUDY_SCRIPT, method=f"{mode}-scaling", config=config, metrics=metrics,
                       provenance=prov, status=status, notes=notes,
                       energy=energy or not_measured("the training wrote no energy entry"))


# --------------------------------------------------------------------------------------------
# 03_overlap.py: flags, the table, the record

OVERLAP_SCRIPT = "labs/lab05_scaling/03_overlap.py"
#: ``03_overlap.py --dry-run``'s image side and batch: ResNet-50 at 224x224 took 11 minutes on a 2-core CPU.
OVERLAP_DRY_RUN_IMAGE_SIZE, OVERLAP_DRY_RUN_BATCH = 32, 8


def add_overlap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``03_overlap.py``: the model, the bucket sizes, the steps, then the common ones."""
    from common.models import add_image_model_args  # imports torch

    group = parser.add_argument_group("what to measure")
    add_image_model_args(group, model="resnet50", image_size=224)
    group.add_argument("--bucket-cap-mb", default="1,25,100,1000",
                       help="bucket sizes to compare, MiB, comma-separated; 1000 is one bucket for most models "
                            "(default: %(default)s)")
    add_former_names(group, group.add_argument("--repeats", type=positive_int, default=10,
                                               help="timed steps per bucket size, each with and without sync "
                                                    "(default: %(default)s)"), "--steps")
    group.add_argument("--warmup-steps", type=positive_int, default=2,
                       help="untimed steps (of each kind) per bucket size (default: %(default)s)")
    add_lr_arg(group, default=0.01)
    add_common_args(parser, batch_size=32, epochs_and_steps=False, data=False,  # random images, --repeats steps
                    dry_run=f"images of at most {OVERLAP_DRY_RUN_IMAGE_SIZE}x{OVERLAP_DRY_RUN_IMAGE_SIZE}, a batch of "
                            f"at most {OVERLAP_DRY_RUN_BATCH}, two timed steps per bucket size: checks that everything "
                            "runs")
    return parser


def read_overlap_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``03_overlap.py``'s flags; ``--dry-run`` caps the steps, the image side and the batch (the model stays)."""
    return apply_dry_run(parser.parse_args(argv), repeats=2, warmup_steps=1, image_size=OVERLAP_DRY_RUN_IMAGE_SIZE,
                         batch_size=OVERLAP_DRY_RUN_BATCH)


def parse_buckets(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise FlagError(f"--bucket-cap-mb takes numbers separated by commas, e.g. 1,25,100; got {text!r}") from None
    if not values or min(values) <= 0:
        raise FlagError(f"--bucket-cap-mb needs sizes above 0 MiB, got {text!r}")
    return values


OVERLAP_HEADER = (f"{'bucket_cap_mb':>13} {'buckets':>7} {'step (ms)':>10} {'no_sync (ms)':>13} {'exposed (ms)':>13} "
                  f"{'alone (ms)':>11} {'hidden':>7}")


def overlap_row(row: Mapping[str, Any]) -> str:
    """One bucket size of the overlap table (under :data:`OVERLAP_HEADER`); ``*``: hidden was clamped (a note
    says why)."""
    hidden = row["hidden_fraction"]
    exposed_text = "noise" if row["exposed_is_noise"] else f"{1e3 * row['exposed_comm_s']:.1f}"
    hidden_text = "n/a" if hidden is None else f"{hidden:.0%}"
    hidden_text += "*" if row["hidden_clamped_because"] else ""
    return (f"{row['bucket_cap_mb']:>13g} {row['buckets']:>7} {1e3 * row['step_s']:>10.1f} "
            f"{1e3 * row['no_sync_step_s']:>13.1f} {exposed_text:>13} {1e3 * row['comm_alone_s']:>11.1f} "
            f"{hidden_text:>7}")


def write_overlap_record(args: argparse.Namespace, ctx: Any, rows: list[dict[str, Any]], *, parameter_bytes: int,
                         buckets_mb: list[float], threads: int, placement: list[dict[str, Any]],
                         energy: dict[str, Any]) -> Path:
    """The notes (the best bucket size, noise, clamped fractions), printed, and the record with every bucket size."""
    best = min(rows, key=lambda r: r["exposed_comm_s"])
    notes = [f"least exposed communication with bucket_cap_mb={best['bucket_cap_mb']:g}: "
             + ("within the timing spread (noise)" if best["exposed_is_noise"] else
                f"{1e3 * best['exposed_comm_s']:.1f} ms per step")]
    if any(r["exposed_is_noise"] for r in rows):
        notes.append("exposed 'noise': the step with sync was slower than without by no more than the steps' "
                     "interquartile range, which is as close as this timing can tell apart")
    notes += [f"hidden {r['hidden_fraction']:.0%}* at bucket_cap_mb={r['bucket_cap_mb']:g}: "
              f"{r['hidden_clamped_because']}" for r in rows if r["hidden_clamped_because"]]
    metrics = {
        "world_size": ctx.world_size, "parameter_bytes": parameter_bytes, "buckets": rows,
        "best_bucket_cap_mb": best["bucket_cap_mb"], "samples_per_step": args.batch_size * ctx.world_size,
        "timing_method": ("time.perf_counter per step, device synchronised before each clock read, ranks at "
                          "a barrier before each step, steps with and without no_sync() alternating; per "
                          "step the slowest rank; median over the timed steps"),
    }
    config = config_dict(args, resolved_device=str(ctx.device), bucket_caps_mb=buckets_mb,
                         parameter_bytes=parameter_bytes, threads=threads, parameter_mib=parameter_bytes / MiB)
    record = make_record(lab=LAB, script=OVERLAP_SCRIPT, method="overlap", config=config, metrics=metrics,
                         notes=notes, energy=energy,
                         provenance=provenance(ctx.device, ctx.world_size, {"distributed": ctx.describe(),
                                                                            "placement": placement}))
    for note in notes:
        print(f"note: {note}", flush=True)
    path = write_record(record, args.results_dir)
    print(f"record: {path}", flush=True)
    return path


def nothing_to_overlap(args: argparse.Namespace, ctx: Any, placement: list[dict[str, Any]], parameter_bytes: int,
                       buckets_mb: list[float], threads: int) -> int:
    """One rank: DDP all-reduces nothing, so no communication exists to hide; say so, time nothing."""
    reason = ("one rank: DDP has no other rank to all-reduce gradients with, so there is no communication to "
              "overlap and nothing was timed; start two or more ranks (torchrun --nproc_per_node=2, srun)")
    print(f"overlap: 1 rank, backend {ctx.backend}: {reason[len('one rank: '):]}", flush=True)  # the only rank
    if ctx.is_main:
        metrics = {"world_size": 1, "parameter_bytes": parameter_bytes, "buckets": [], "nothing_to_overlap": reason}
        config = config_dict(args, resolved_device=str(ctx.device), bucket_caps_mb=buckets_mb,
                             parameter_bytes=parameter_bytes, threads=threads, parameter_mib=parameter_bytes / MiB)
        record = make_record(lab=LAB, script=OVERLAP_SCRIPT, method="overlap", config=config, metrics=metrics,
                             notes=[reason], energy=not_measured("one rank: nothing was timed"),
                             provenance=provenance(ctx.device, 1, {"distributed": ctx.describe(),
                                                                   "placement": placement}))
        print(f"record: {write_record(record, args.results_dir)}", flush=True)
    return 0
