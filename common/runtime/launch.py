"""Who launched this process, and as which rank: torchrun, Slurm's srun, or a plain ``python``.

Everything here reads environment variables and nothing else, so it can be unit-tested with a
patched environment and imported without torch. ``common.runtime.distributed`` turns the answer into a
process group.

The one place where Slurm's variables are mapped onto torchrun's (docs/conventions.md, convention 4):

==================  ===========================================  ==========================
torchrun            Slurm (inside an ``srun`` step)              plain ``python``
==================  ===========================================  ==========================
``RANK``            ``SLURM_PROCID``                             0
``WORLD_SIZE``      ``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS``  1
``LOCAL_RANK``      ``SLURM_LOCALID``                            0
``MASTER_ADDR``     first host of ``SLURM_STEP_NODELIST``        127.0.0.1
``MASTER_PORT``     derived from ``SLURM_JOB_ID`` (+ step id)    a free port when needed
==================  ===========================================  ==========================

A batch script itself (outside ``srun``) also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N``; it is
*not* an N-process launch, which is why the Slurm branch needs an ``srun`` step (``SLURM_STEP_ID``).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass
from typing import Any, Mapping

#: Ports derived from the Slurm job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN), below Linux's
#: ephemeral ports (32768 and up), which the kernel hands out to outgoing connections.
PORT_BASE = 20000
PORT_SPAN = 10000
#: How far each step id moves the port: the span over the golden ratio, so that a job's first steps
#: land far (>= 560 ports for steps 1-10) from the ports of jobs with nearby ids.
STEP_STRIDE = 6180


@dataclass(frozen=True)
class LaunchInfo:
    """How this process was started and where its peers are."""

    launcher: str  # "torchrun", "slurm" or "single"
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def expand_hostlist(expression: str) -> list[str]:
    """Expand a Slurm host list such as ``gpu[01-03,07],login1`` into host names.

    Handles several bracket groups in one name (``r[1-2]n[1-2]``) and zero padding; this is what
    ``scontrol show hostnames`` does, without needing Slurm's tools on the PATH.
    """
    hosts: list[str] = []
    for item in _split_top_level(expression.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(expression: str) -> list[str]:
    items, depth, current = [], 0, []
    for char in expression:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if current:
        items.append("".join(current))
    return [item for item in (i.strip() for i in items) if item]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]+)\]", item)
    if not match:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    names = []
    for part in match.group(1).split(","):
        if "-" in part:
            low, high = part.split("-", 1)
            width = len(low)
            names.extend(f"{prefix}{n:0{width}d}" for n in range(int(low), int(high) + 1))
        else:
            names.append(f"{prefix}{part}")
    return [expanded for name in names for expanded in _expand_one(name + suffix)]


def port_from_job(job_id: str | int, step_id: str | int | None = None) -> int:
    """The rendezvous port of a Slurm job step: every task of the step computes the same one.

    ``PORT_BASE + (job id + STEP_STRIDE x step id) mod PORT_SPAN``: consecutive job ids get
    consecutive ports, so 10,000 jobs in a row never share one, and a job's steps get ports of their
    own. ``slurm/lib/job_header.sh`` defines the same function in the shell (tests check that they
    agree); a job header exports its result as ``MASTER_PORT``, which then takes precedence.
    """
    step = str(step_id) if step_id is not None else ""
    return PORT_BASE + (int(job_id) + STEP_STRIDE * (int(step) if step.isdigit() else 0)) % PORT_SPAN


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (for single-process runs that still need a group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read torchrun's variables, else Slurm's (inside ``srun``), else assume one process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        port = env.get("MASTER_PORT")
        return LaunchInfo(
            launcher="torchrun",
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            node_rank=_int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(port) if port and port.isdigit() else None,
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and "SLURM_JOB_ID" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_hostlist(nodelist) if nodelist else []
        port = env.get("MASTER_PORT")
        return LaunchInfo(
            launcher="slurm",
            rank=_int(env, "SLURM_PROCID", 0),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            world_size=world,
            node_rank=_int(env, "SLURM_NODEID", 0),
            master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
            master_port=int(port) if port and port.isdigit()
            else port_from_job(env["SLURM_JOB_ID"], env.get("SLURM_STEP_ID")),
        )
    return LaunchInfo(launcher="single", rank=0, local_rank=0, world_size=1, node_rank=0,
                      master_addr=None, master_port=None)


def rank_tag(env: Mapping[str, str] | None = None) -> str:
    """``[host:rank]``, the prefix for per-rank diagnostics."""
    return f"[{socket.gethostname().split('.')[0]}:{detect_launch(env).rank}]"


def _tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: three nodes with 2, one with 1) as a list."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def local_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """Processes of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``, Slurm's tasks per node).

    ``None`` when the launcher does not say. Used to refuse more processes than GPUs on a node.
    """
    env = os.environ if env is None else env
    launch = detect_launch(env)
    if launch.launcher == "single":
        return 1
    if launch.launcher == "torchrun":
        value = _int(env, "LOCAL_WORLD_SIZE", 0)
        return value or None
    counts = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    if len(set(counts)) == 1:
        return counts[0]
    return counts[launch.node_rank] if 0 <= launch.node_rank < len(counts) else None
