"""What this process can use, and whether it matches what Slurm allocated.

``collect_environment()`` gathers versions (Python, PyTorch, torchvision, CUDA, cuDNN, NCCL), which
back ends work (CUDA, cuDNN, NCCL, Gloo), every visible GPU (name, memory, compute capability, a tiny
computation on it), the CPUs this process may run on, and the Slurm allocation as the ``SLURM_*``
variables and ``CUDA_VISIBLE_DEVICES`` describe it. ``allocation_agreement(info)`` compares the two
and returns one warning per disagreement, in words a student can act on, for example::

    Slurm allocated 4 GPU(s) on this node (SLURM_GPUS_ON_NODE=4) but PyTorch sees 0: the allocation's
    GPUs are not visible to this process ...

``chapters/ch04_deep_learning/gpu_check.py`` prints these; Lab-01's environment check extends them.
Both take the flags of :func:`add_check_args` (``--json --strict --no-smoke-test``).
Importing this module does not import torch (``allocation_agreement`` is pure logic on the dict);
``collect_environment`` does.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
from typing import Any, Mapping

from common.runtime.cpus import usable_cpus
from common.runtime.machine import cpu_description, gpu_description
from common.units import format_bytes

#: Slurm variables that say how many GPUs this node's share of the job has, most specific first.
#: ``SLURM_GPUS`` (the job's ``--gpus``) counts the whole job, so it is used only on one node.
SLURM_GPU_KEYS = ("SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS")
#: Everything about the allocation that is copied into the report as it was found.
SLURM_ALLOCATION_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_CPUS_PER_TASK",
    "SLURM_CPUS_ON_NODE",
    *SLURM_GPU_KEYS,
    "SLURM_GPUS_PER_TASK",
)


def software_versions() -> dict[str, Any]:
    """Python, PyTorch, torchvision, CUDA, cuDNN and NCCL versions (imports torch)."""
    import torch

    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    try:  # the installed version, without importing torchvision (about 2 s)
        from importlib.metadata import PackageNotFoundError, version

        versions["torchvision"] = version("torchvision")
    except PackageNotFoundError:
        versions["torchvision"] = None
    try:
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    except (AttributeError, RuntimeError):
        versions["nccl"] = None
    return versions


def add_check_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--json``, ``--strict`` and ``--no-smoke-test`` (``smoke_test``): the flags of every environment check."""
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (the findings plus a 'warnings' list) instead of text "
                             "(default: off)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when any warning was found (default: off, always exit 0)")
    parser.add_argument("--no-smoke-test", dest="smoke_test", action="store_false",
                        help="do not run a tiny computation on each GPU (default: run it)")
    return parser


def count_gpu_spec(value: str | None) -> int | None:
    """GPUs named by a Slurm GPU variable; ``None`` when unset or unreadable.

    Slurm writes them in three shapes: a count (``4``), a typed count (``a100:4``, or several
    ``a100:2,v100:1``) and a list of device indices (``0,1,2,3``, in ``SLURM_JOB_GPUS``).
    """
    if value is None or not value.strip():
        return None
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if any(":" in part for part in parts):  # typed counts: a100:2,v100:1
        counts = [part.rsplit(":", 1)[1] for part in parts]
        return sum(int(c) for c in counts) if all(c.isdigit() for c in counts) else None
    if len(parts) == 1 and parts[0].isdigit():
        return int(parts[0])  # a bare count (in a list variable this would be index 0: see slurm_gpu_count)
    return len(parts) if all(part.isdigit() for part in parts) else None


def slurm_gpu_count(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    """GPUs Slurm gave this node's share of the job, and the variable that said so."""
    for key in SLURM_GPU_KEYS:
        value = env.get(key)
        if value is None or not value.strip():
            continue
        if key == "SLURM_GPUS" and env.get("SLURM_JOB_NUM_NODES", "1") not in ("", "1"):
            continue  # the job's total over several nodes says nothing about this one
        if key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):  # lists of indices: "0" is one GPU, not zero
            parts = [part for part in value.split(",") if part.strip()]
            return len(parts), key
        count = count_gpu_spec(value)
        if count is not None:
            return count, key
    return None, None


def visible_devices_count(value: str | None) -> int | None:
    """GPUs ``CUDA_VISIBLE_DEVICES`` lets a process see; ``None`` when it is unset (no restriction).

    An empty value hides every GPU; so do ``-1`` and Slurm's old ``NoDevFiles``. CUDA reads the list
    up to the first invalid entry.
    """
    if value is None:
        return None
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry in ("NoDevFiles",) or entry.startswith("-"):
            break
        count += 1
    return count


def _gpu_details(torch: Any, index: int, smoke_test: bool) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    described = gpu_description(props.name, (props.major, props.minor))
    gpu: dict[str, Any] = {
        "index": index,
        "name": props.name,
        "total_memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": int(props.multi_processor_count),
        # bf16 runs natively from compute capability 8.0 (A100); older GPUs only emulate it, slowly.
        "bf16_native": described["bf16"] == "native",
        "peak_tflops": described["peak_tflops"],  # datasheet, dense (common.precision)
    }
    if smoke_test:
        try:  # a GPU can be listed and still fail on first use (driver mismatch, a GPU in a bad state)
            value = (torch.ones(2, device=f"cuda:{index}") * 2).sum().item()
            gpu["smoke_test"] = "ok" if value == 4.0 else f"wrong result {value}"
        except RuntimeError as err:
            gpu["smoke_test"] = f"failed: {str(err).splitlines()[0]}"
    return gpu


def collect_environment(env: Mapping[str, str] | None = None, *, smoke_test: bool = True) -> dict[str, Any]:
    """Everything :func:`allocation_agreement` and a student need to know about this process.

    ``env`` defaults to ``os.environ``; tests pass a patched mapping. With ``smoke_test`` each GPU
    also runs a tiny computation, because a GPU that is listed is not always a GPU that works.
    """
    import torch
    import torch.distributed as dist


    env = os.environ if env is None else env
    cuda_available = torch.cuda.is_available()
    gpu_count = torch.cuda.device_count() if cuda_available else 0
    slurm_gpus, slurm_gpu_source = slurm_gpu_count(env)
    slurm_cpus = env.get("SLURM_CPUS_PER_TASK", "")
    versions = software_versions()
    nccl_built = bool(dist.is_available() and dist.is_nccl_available())
    if versions.get("nccl") is None and nccl_built:
        try:  # the version of the NCCL built into this PyTorch, readable without a GPU
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError, TypeError):
            pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python_executable": sys.executable,
        "versions": versions,
        "backends": {
            "cuda": cuda_available,
            "cudnn": bool(cuda_available and torch.backends.cudnn.is_available()),
            # "built with" for the distributed back ends: NCCL also needs a GPU to be usable.
            "nccl_built": nccl_built,
            "gloo_built": bool(dist.is_available() and dist.is_gloo_available()),
            "cuda_build": torch.version.cuda is not None,
        },
        "gpus": [_gpu_details(torch, i, smoke_test) for i in range(gpu_count)],
        # The CPU's model and flags: whether bf16 (and fp16) run natively or are emulated, slowly.
        "cpu": cpu_description(),
        "cpus": {
            "node_cpus": os.cpu_count(),
            "usable_cpus": usable_cpus(),
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": env.get("OMP_NUM_THREADS"),
        },
        "slurm": {
            "in_job": "SLURM_JOB_ID" in env,
            "variables": {key: env[key] for key in SLURM_ALLOCATION_KEYS if key in env},
            "gpus": slurm_gpus,
            "gpus_source": slurm_gpu_source,
            "gpus_per_task": count_gpu_spec(env.get("SLURM_GPUS_PER_TASK")),
            "cpus_per_task": int(slurm_cpus) if slurm_cpus.isdigit() else None,
        },
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "cuda_visible_count": visible_devices_count(env.get("CUDA_VISIBLE_DEVICES")),
        "torch_gpus": gpu_count,
    }


def allocation_agreement(info: Mapping[str, Any]) -> list[str]:
    """Warnings where what Slurm allocated and what PyTorch can use disagree (empty: they agree).

    Pure logic on :func:`collect_environment`'s dictionary, so every case is testable without a GPU.
    """
    warnings: list[str] = []
    slurm = info.get("slurm", {})
    torch_gpus = int(info.get("torch_gpus") or 0)
    slurm_gpus, source = slurm.get("gpus"), slurm.get("gpus_source")
    per_task = slurm.get("gpus_per_task")
    visible = info.get("cuda_visible_devices")
    visible_count = info.get("cuda_visible_count")
    cuda_build = info.get("backends", {}).get("cuda_build", True)

    if slurm_gpus and torch_gpus == 0:
        if not cuda_build:
            why = "this PyTorch is a CPU-only build (torch.version.cuda is None): install a CUDA build"
        elif visible is not None and visible_count == 0:
            why = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; do not overwrite it in your job script"
        else:
            why = ("CUDA cannot reach them: check the driver with nvidia-smi and that the loaded CUDA "
                   "module matches this PyTorch build")
        warnings.append(f"Slurm allocated {slurm_gpus} GPU(s) on this node ({source}) but PyTorch sees 0: "
                        f"the allocation's GPUs are not visible to this process; {why}")
    elif slurm_gpus and torch_gpus != slurm_gpus and torch_gpus != per_task:
        warnings.append(f"Slurm allocated {slurm_gpus} GPU(s) on this node ({source}) but PyTorch sees "
                        f"{torch_gpus}; expected when srun binds GPUs to tasks (--gpus-per-task, --gpu-bind), "
                        "otherwise check CUDA_VISIBLE_DEVICES")
    if slurm.get("in_job") and not slurm_gpus and torch_gpus > 0 and visible is None:
        warnings.append(f"PyTorch sees {torch_gpus} GPU(s) but this Slurm job asked for none "
                        "(no SLURM_*GPUS* variable, CUDA_VISIBLE_DEVICES unset): they may belong to other "
                        "jobs; request them with --gres=gpu:N or --gpus=N")
    if visible_count and torch_gpus and visible_count != torch_gpus:
        warnings.append(f"CUDA_VISIBLE_DEVICES={visible!r} lists {visible_count} GPU(s) but PyTorch sees "
                        f"{torch_gpus}: an entry names a GPU that does not exist on this node")
    for gpu in info.get("gpus", []):
        result = gpu.get("smoke_test")
        if result is not None and result != "ok":
            warnings.append(f"GPU {gpu.get('index')} ({gpu.get('name')}) is listed but a tiny computation "
                            f"on it {result}")
    if torch_gpus and not info.get("backends", {}).get("nccl_built", False):
        warnings.append("this PyTorch has no NCCL: multi-GPU DDP will not run; install a CUDA build with NCCL")

    cpus = info.get("cpus", {})
    slurm_cpus = slurm.get("cpus_per_task")
    usable = cpus.get("usable_cpus")
    threads = cpus.get("torch_threads")
    if slurm_cpus and usable and usable < slurm_cpus:
        warnings.append(f"Slurm gave {slurm_cpus} CPU(s) per task (SLURM_CPUS_PER_TASK) but this process may "
                        f"run on only {usable}: check srun's --cpu-bind and --cpus-per-task")
    if slurm_cpus and threads and threads > slurm_cpus:
        warnings.append(f"PyTorch will start {threads} threads on {slurm_cpus} allocated CPU(s): they will "
                        "fight over the cores; export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK "
                        "(slurm/module-loads/pytorch.sh does)")
    return warnings


def format_environment(info: Mapping[str, Any], warnings: list[str]) -> str:
    """The human-readable report of :func:`collect_environment` and its warnings."""
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    versions, backends = info["versions"], info["backends"]
    lines = [
        f"host            {info['hostname']} ({info['platform']})",
        f"python          {versions.get('python')} ({info['python_executable']})",
        f"torch           {versions.get('torch')}   torchvision {versions.get('torchvision')}",
        f"PyTorch built with CUDA {versions.get('cuda') or 'none (CPU-only build)'}, cuDNN "
        f"{versions.get('cudnn') or 'n/a'}   NCCL {versions.get('nccl') or 'n/a'}  (the build's, not the machine's)",
        f"available       CUDA {yes(backends['cuda'])} | cuDNN {yes(backends['cudnn'])} | "
        f"NCCL built {yes(backends['nccl_built'])} | Gloo built {yes(backends['gloo_built'])}",
        f"GPUs (PyTorch)  {info['torch_gpus']}",
    ]
    for gpu in info["gpus"]:
        lines.append(f"  cuda:{gpu['index']}  {gpu['name']} | {format_bytes(gpu['total_memory_bytes'], unit='GiB')} | "
                     f"capability {gpu['capability']} | {gpu['multiprocessors']} SMs | "
                     f"bf16 {'native' if gpu['bf16_native'] else 'emulated'} | test {gpu.get('smoke_test', 'skipped')}"
                     + (f" | datasheet bf16 {gpu['peak_tflops']['bf16']:g} TFLOP/s"
                        if "bf16" in gpu.get("peak_tflops", {}) else ""))
    cpus, slurm = info["cpus"], info["slurm"]
    cpu = info.get("cpu")
    if cpu:
        flags = " ".join(flag for flag, present in cpu["isa"].items() if present) or "none of the bf16/fp16 flags"
        lines.append(f"CPU             {cpu['model']} | {cpu['physical_cores'] or '?'} cores, "
                     f"{cpu['logical_cpus']} CPUs | {flags} | bf16 {cpu['bf16']}, fp16 {cpu['fp16']}")
    lines.append(f"CPUs            node {cpus['node_cpus']} | usable by this process {cpus['usable_cpus']} | "
                 f"torch threads {cpus['torch_threads']} | OMP_NUM_THREADS {cpus['omp_num_threads'] or 'unset'}")
    if slurm["in_job"]:
        lines.append(f"Slurm           job {slurm['variables'].get('SLURM_JOB_ID')} | CPUs per task "
                     f"{slurm['cpus_per_task'] or 'unset'} | GPUs on this node "
                     f"{slurm['gpus'] if slurm['gpus'] is not None else 'none requested'}"
                     + (f" ({slurm['gpus_source']})" if slurm["gpus_source"] else ""))
        for key, value in slurm["variables"].items():
            lines.append(f"  {key}={value}")
    else:
        lines.append("Slurm           not inside a Slurm job (no SLURM_JOB_ID)")
    visible = info["cuda_visible_devices"]
    lines.append(f"CUDA_VISIBLE_DEVICES  {'unset (every GPU of the node)' if visible is None else repr(visible)}")
    if warnings:
        lines.append(f"agreement       {len(warnings)} problem(s):")
        lines.extend(f"  WARNING: {warning}" for warning in warnings)
    else:
        lines.append("agreement       ok: what Slurm allocated is what PyTorch can use")
    return "\n".join(lines)
