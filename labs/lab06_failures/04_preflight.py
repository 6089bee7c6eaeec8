#!/usr/bin/env python3
"""Lab-06 step 4: the multi-node checklist as one command, before a long job starts.

Usage:
    python labs/lab06_failures/04_preflight.py                 # this machine as one node, one task
    torchrun --standalone --nproc_per_node=4 labs/lab06_failures/04_preflight.py
    srun --kill-on-bad-exit=1 python labs/lab06_failures/04_preflight.py    # inside an allocation
    sbatch preflight_2node.sbatch    # rendered from sbatch/preflight_2node.sbatch.j2, see the README

What it teaches: most multi-node failures are visible before the first step. Every task resolves
``MASTER_ADDR`` and opens a TCP connection to rank 0 at the rendezvous port (a job that silently
"rendezvoused" on localhost, or a firewall, shows here in seconds instead of as a hang); its
``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID`` must be the rank, local rank and node that the
launch gives it; it says which GPUs it sees (all of the node's with ``--gres``, one with
``--gpus-per-task``) and whether they reach each other directly (peer access); on GPUs, one NCCL
all-reduce with ``NCCL_DEBUG=INFO`` says which transport NCCL picked (NVLink/PCIe P2P, shared memory,
InfiniBand/RoCE, or TCP sockets). Each task sends its findings to rank 0 over that same connection;
rank 0 prints one table, one verdict line, and writes a record. No process group is needed for the
checks, so they work where the process group would hang.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time

from common.cli import add_run_args, config_dict, positive_float, script_parser
from common.errors import UserError, run_main
from common.results import make_record, provenance, write_record
from common.runtime.launch import detect_launch, free_port, rank_tag
from labs.lab06_failures.lab06_shared import LAB, check_ids, nccl_transport, table

SCRIPT = "labs/lab06_failures/04_preflight.py"


def rendezvous_point(launch) -> tuple[str, int]:
    """Where rank 0 listens: the launch's address and port. Under torchrun the agent's store already
    holds ``MASTER_PORT`` (reachable, or there would be no ranks), so the check uses the next port."""
    if launch.launcher == "single":
        return "127.0.0.1", free_port()
    if launch.master_addr is None or launch.master_port is None:
        raise UserError("MASTER_ADDR/MASTER_PORT are not set: run inside srun (the job header exports them) "
                        "or under torchrun")
    return launch.master_addr, launch.master_port + (1 if launch.launcher == "torchrun" else 0)


def my_findings(launch, device: str) -> dict:
    """What this task sees: its identity, its host, its GPUs."""
    env = os.environ
    found = {"rank": launch.rank, "local_rank": launch.local_rank, "node": launch.node_rank,
             # The node: Slurm's name for it in a job (several slurmd can share a machine, as on the test
             # cluster), else the short host name.
             "host": env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0], "world": launch.world_size,
             "slurm": {k: env.get(f"SLURM_{k}") for k in ("PROCID", "LOCALID", "NODEID")},
             "cuda_visible": env.get("CUDA_VISIBLE_DEVICES", "(unset)"), "gpus": [], "peer_access": None}
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            found["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
            found["peer_access"] = all(torch.cuda.can_device_access_peer(a, b)
                                       for a in range(count) for b in range(count) if a != b)
    return found


def gather_at_rank0(launch, addr: str, port: int, findings: dict, timeout_s: float) -> list[dict] | None:
    """Every task's findings at rank 0, over a plain TCP connection to the rendezvous address: that the
    connection opens is the reachability check. Rank 0 returns the list (unreached ranks get an entry
    saying so); other ranks return None, once rank 0 has closed its listener and answered: under srun the
    process group's store takes the same port next, and a rank that went on early would knock on the
    listener instead (rank 0 read the store's handshake as a report)."""
    if launch.rank != 0:
        deadline, error = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:  # rank 0 may not be listening yet
            try:
                conn = socket.create_connection((addr, port), timeout=5)
            except OSError as err:
                error = err
                time.sleep(0.5)
                continue
            with conn, conn.makefile() as stream:
                conn.sendall(json.dumps(findings).encode() + b"\n")
                conn.settimeout(timeout_s + 5)  # rank 0 answers when every task is in or its wait is over
                with contextlib.suppress(OSError):  # else rank 0 has this report or is gone: the group says which
                    stream.readline()
            return None
        raise UserError(f"{rank_tag()} cannot reach rank 0 at {addr}:{port} ({error}): a firewall, a wrong "
                        "MASTER_ADDR, or rank 0 not running")
    reports, reported = {0: findings}, []
    with socket.create_server(("", port)) as server:
        server.settimeout(1.0)
        deadline = time.monotonic() + timeout_s
        if launch.world_size == 1:  # one task: check that this host reaches itself at that address
            with socket.create_connection((addr, port), timeout=5):
                pass
        while len(reports) < launch.world_size and time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            stream = conn.makefile()
            report = json.loads(stream.readline())
            reports[report["rank"]] = report
            reported.append((conn, stream))
    for conn, stream in reported:  # the listener is closed: each may go on to the process group now
        with conn, stream, contextlib.suppress(OSError):
            conn.sendall(b"all in\n")
    return [reports.get(rank, {"rank": rank, "unreached": True}) for rank in range(launch.world_size)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    launch = detect_launch()
    try:
        address = socket.gethostbyname(launch.master_addr or "127.0.0.1")
    except OSError as err:
        raise UserError(f"MASTER_ADDR {launch.master_addr!r} does not resolve on {socket.gethostname()} ({err})")
    addr, port = rendezvous_point(launch)
    reports = gather_at_rank0(launch, addr, port, my_findings(launch, args.device), args.timeout)
    transport = nccl_transport(args.device, launch.world_size)  # every task takes part (a collective)
    if reports is None:
        return 0
    problems = check_ids(reports, launch.launcher)
    unreached = [r["rank"] for r in reports if r.get("unreached")]
    if unreached:
        problems.insert(0, f"rank(s) {', '.join(map(str, unreached))} did not reach {addr}:{port} "
                           f"within {args.timeout:g} s")
    rows = [{"rank": r["rank"], "host": r.get("host", "?"), "local": r.get("local_rank", "?"),
             "node": r.get("node", "?"), "SLURM_PROCID/LOCALID/NODEID": "/".join(
                 str(v) for v in r["slurm"].values()) if any((r.get("slurm") or {}).values()) else "not set",
             "reached rank 0": "no" if r.get("unreached") else "yes",
             "GPUs": ", ".join(r.get("gpus", [])) or "none", "CUDA_VISIBLE_DEVICES": r.get("cuda_visible", "?"),
             "peer access": {None: "-", True: "yes", False: "no"}[r.get("peer_access")]} for r in reports]
    nodes = len({r.get("host") for r in reports})
    print(f"MASTER_ADDR {launch.master_addr or '127.0.0.1'} resolves to {address}; rank 0 listened on "
          f"{addr}:{port}; launcher {launch.launcher}")
    print(table(rows))
    print(f"NCCL transport: {transport}")
    verdict = (f"preflight FAILED: {'; '.join(problems)}" if problems else
               f"preflight ok: {launch.world_size} task(s) on {nodes} node(s) reached {addr}:{port}, ids consistent, "
               f"transport: {transport}")
    print(verdict)
    record = make_record(lab=LAB, script=SCRIPT, method="preflight", config=config_dict(args),
                         status="failed" if problems else "ok",
                         metrics={"verdict": verdict, "problems": problems, "tasks": reports, "transport": transport,
                                  "master_addr": launch.master_addr, "resolved": address, "port": port},
                         provenance=provenance(None, launch.world_size))
    write_record(record, args.results_dir)
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--timeout", type=positive_float, default=60.0,
                        help="seconds rank 0 waits for every task to report (default: %(default)s)")
    add_run_args(parser, seed=None, dry_run=None)  # one check, nothing drawn at random
    return parser


if __name__ == "__main__":
    sys.exit(run_main(main))
