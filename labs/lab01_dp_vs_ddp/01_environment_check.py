#!/usr/bin/env python3
"""Lab-01 step 1: can this allocation run DataParallel and DDP, and how are its GPUs connected?

Usage:
    python labs/lab01_dp_vs_ddp/01_environment_check.py                  # readable report
    python labs/lab01_dp_vs_ddp/01_environment_check.py --json           # the same as JSON on stdout
    python labs/lab01_dp_vs_ddp/01_environment_check.py --strict         # exit 1 on any warning
    srun --ntasks=1 python labs/lab01_dp_vs_ddp/01_environment_check.py  # inside an allocation
    sbatch env_check.sbatch         # rendered from sbatch/env_check.sbatch.j2, see the README

(One process looks at the whole node, so there is no torchrun form.)

What it teaches: before timing DP against DDP, know what you were given. Chapter 4's check
(``common.runtime.envcheck``: versions, GPUs, CPUs, the Slurm allocation, and a warning where the allocation
and the devices this process sees disagree) plus what matters for multi-GPU training:

- **Topology**: which GPU pairs can read each other's memory directly (peer access: DataParallel's
  copies and NCCL's transfers skip the host), and ``nvidia-smi topo -m``'s link between every pair
  (``NV#`` = NVLink, ``PIX``/``PXB``/``PHB`` = PCIe, ``NODE``/``SYS`` = across CPU sockets).
  The two number GPUs differently: ``nvidia-smi`` (NVML) counts every GPU of the node in PCI order,
  PyTorch (CUDA) counts only the visible ones, fastest first or as ``CUDA_VISIBLE_DEVICES`` lists
  them. ``GPU0`` of the topology need not be ``cuda:0``, so each ``cuda:N`` is matched to its row
  of the topology by PCI bus id, and the links are shown in CUDA's numbering next to peer access.
- **Communication back ends**: NCCL (GPUs) and Gloo (CPUs) built into this PyTorch, and a real
  one-process all-reduce through each, because "built" is not "works".

The result is also written as a record (lab ``lab01``, method ``env``) so the report shows where the
other runs ran.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shutil
import subprocess
from typing import Any, Mapping

from common.cli import output_dir, script_parser
from common.measure.energy import EnergyMeter
from common.runtime.envcheck import add_check_args, allocation_agreement, collect_environment, format_environment
from common.errors import run_main
from common.results import make_record, provenance, write_record
from labs.lab01_dp_vs_ddp.lab01_shared import LAB, format_checks, parse_topology

SCRIPT = "labs/lab01_dp_vs_ddp/01_environment_check.py"


def nvidia_smi_topology() -> dict[str, Any]:
    """``nvidia-smi topo -m`` as text and parsed, or why it is not available."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"available": False, "reason": "nvidia-smi not found on PATH (no NVIDIA driver here)"}
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return {"available": False, "reason": f"nvidia-smi topo -m failed: {err}"}
    if out.returncode != 0:
        return {"available": False, "reason": f"nvidia-smi topo -m exited {out.returncode}: "
                                               f"{(out.stderr or out.stdout).strip()[:300]}"}
    return {"available": True, "text": out.stdout, "links": parse_topology(out.stdout),
            "bus_ids": nvidia_smi_bus_ids(smi)}


def nvidia_smi_bus_ids(smi: str) -> dict[str, str]:
    """``{"GPU0": "00000000:18:00.0", ...}``: the PCI bus id of every GPU in nvidia-smi's numbering."""
    try:
        out = subprocess.run([smi, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    bus_ids = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        index, _, bus_id = (part.strip() for part in line.partition(","))
        if index.isdigit() and bus_id:
            bus_ids[f"GPU{index}"] = bus_id
    return bus_ids


def cuda_to_topology(count: int, bus_ids: Mapping[str, str]) -> list[dict[str, Any]]:
    """For every visible ``cuda:N``: its PCI bus id and the ``GPUk`` of ``nvidia-smi topo -m`` with the same one."""
    from common.runtime.device import normalise_bus_id, pci_bus_id  # imports torch

    by_bus = {normalise_bus_id(bus_id): name for name, bus_id in bus_ids.items()}
    rows = []
    for index in range(count):
        bus_id = pci_bus_id(index)
        rows.append({"cuda": index, "bus_id": bus_id,
                     "topology_name": by_bus.get(normalise_bus_id(bus_id)) if bus_id else None})
    return rows


def cuda_links(mapping: list[dict[str, Any]], links: Mapping[str, Mapping[str, str]]) -> list[list[str | None]]:
    """``matrix[i][j]``: the topology's link between ``cuda:i`` and ``cuda:j`` (``None`` where unknown)."""
    names = [row["topology_name"] for row in mapping]
    return [[None if i == j or a is None or b is None else links.get(a, {}).get(b) for j, b in enumerate(names)]
            for i, a in enumerate(names)]


def peer_access_matrix(torch: Any, count: int) -> list[list[bool | None]]:
    """``matrix[i][j]``: can GPU ``i`` read and write GPU ``j``'s memory directly (``None`` on the diagonal)."""
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)]
            for i in range(count)]


def backend_test(backend: str, device: str) -> dict[str, Any]:
    """Start a one-process group with ``backend``, all-reduce a tensor on ``device``, tear it down."""
    import torch
    import torch.distributed as dist

    from common.runtime.launch import free_port

    if dist.is_initialized():
        return {"ok": None, "detail": "skipped: a process group is already running in this process"}
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=_dt.timedelta(seconds=60))
        try:
            tensor = torch.ones(4, device=device)
            dist.all_reduce(tensor)
            ok = bool(tensor.sum().item() == 4.0)
            return {"ok": ok, "detail": f"all-reduce on {device}: {'ok' if ok else 'wrong result'}"}
        finally:
            dist.destroy_process_group()
    except (RuntimeError, ValueError) as err:
        return {"ok": False, "detail": f"failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"}


def multi_gpu_checks(env: Mapping[str, Any], run_backend_tests: bool = True) -> dict[str, Any]:
    """Topology and communication back ends, the part Lab-01 adds to Chapter 4's check."""
    import torch
    import torch.distributed as dist

    count = env["torch_gpus"]
    checks: dict[str, Any] = {
        "distributed_available": dist.is_available(),
        "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
        "gloo_available": bool(dist.is_available() and dist.is_gloo_available()),
        "peer_access": peer_access_matrix(torch, count) if count > 1 else [],
        "topology": nvidia_smi_topology(),
        "backend_tests": {},
    }
    topology = checks["topology"]
    if count and topology["available"]:
        checks["cuda_to_topology"] = cuda_to_topology(count, topology.get("bus_ids", {}))
        checks["cuda_links"] = cuda_links(checks["cuda_to_topology"], topology["links"])
    if run_backend_tests and checks["gloo_available"]:
        checks["backend_tests"]["gloo"] = backend_test("gloo", "cpu")
    if run_backend_tests and checks["nccl_available"] and count > 0:
        checks["backend_tests"]["nccl"] = backend_test("nccl", "cuda:0")
    return checks


def lab_warnings(env: Mapping[str, Any], checks: Mapping[str, Any]) -> list[str]:
    """What would make this lab's DP and DDP runs fail or mislead (pure logic on the two dicts)."""
    warnings = []
    count = env["torch_gpus"]
    if count == 0:
        warnings.append("no GPU visible: 03 runs as the one-device case and 04 uses Gloo on CPU processes; "
                        "the timings say nothing about GPUs")
    elif count == 1:
        warnings.append("one GPU visible: DataParallel and DDP have nothing to split over; ask for 2 or more")
    if not checks["gloo_available"]:
        warnings.append("this PyTorch has no Gloo: CPU runs of 04_ddp_training.py cannot start")
    for name, result in checks["backend_tests"].items():
        if result["ok"] is False:
            warnings.append(f"{name.upper()} is built in but a one-process all-reduce {result['detail']}")
    no_peer = [(i, j) for i, row in enumerate(checks["peer_access"]) for j, ok in enumerate(row) if ok is False]
    if no_peer:
        pairs = ", ".join(f"{i}->{j}" for i, j in no_peer[:8]) + (" ..." if len(no_peer) > 8 else "")
        warnings.append(f"no peer access between GPU pair(s) {pairs}: their copies go through host memory, "
                        "which slows DataParallel and NCCL (see nvidia-smi topo -m)")
    unmatched = [f"cuda:{row['cuda']}" for row in checks.get("cuda_to_topology", []) if row["topology_name"] is None]
    if unmatched:
        warnings.append(f"{', '.join(unmatched)} could not be matched to a row of nvidia-smi topo -m by PCI bus id: "
                        "the topology's GPU numbers may name other GPUs than PyTorch's")
    return warnings


def build_parser() -> argparse.ArgumentParser:
    parser = add_check_args(script_parser(__doc__))  # --json, --strict, --no-smoke-test as in Chapter 4's check
    parser.add_argument("--skip-backend-test", action="store_true",
                        help="do not start one-process NCCL/Gloo groups to test them (default: off)")
    parser.add_argument("--results-dir", type=output_dir, default="results",
                        help="folder where the result record is written (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    with EnergyMeter("cuda:0" if torch.cuda.is_available() else "cpu") as meter:  # over the checks
        env = collect_environment(smoke_test=args.smoke_test)
        checks = multi_gpu_checks(env, run_backend_tests=not args.skip_backend_test)
    allocation_warnings, multi_gpu_warnings = allocation_agreement(env), lab_warnings(env, checks)
    warnings = allocation_warnings + multi_gpu_warnings
    device = "cuda:0" if env["torch_gpus"] else "cpu"
    metrics = {"gpus": env["torch_gpus"], "environment": env, "multi_gpu": checks, "warnings": warnings}
    record = make_record(lab=LAB, script=SCRIPT, method="env", config=vars(args), metrics=metrics,
                         provenance=provenance(device), notes=warnings, energy=meter.result())
    path = write_record(record, args.results_dir)
    if args.json:
        print(json.dumps({**metrics, "record": str(path)}, indent=2, sort_keys=True, default=str))
    else:
        print(format_environment(env, allocation_warnings))  # Chapter 4's report, then the Lab-01 part
        print(format_checks(checks, multi_gpu_warnings))
        print(f"record: {path}")
    return 1 if args.strict and warnings else 0


if __name__ == "__main__":
    run_main(main)
