"""Choosing the device, seeding, and CPU thread settings.

``resolve_device("auto")`` gives the GPU of this process when one is visible and the CPU otherwise,
so the same script runs on a laptop, a CI runner and a GPU node unchanged. Asking for ``cuda`` on a
machine without a GPU is a :class:`~common.errors.UserError` (one line, non-zero exit), not a
CUDA traceback deep inside the first ``.to()``; so is starting more processes on a node than it has
GPUs (two NCCL ranks on one GPU fail at their first collective with "Duplicate GPU detected").

On a GPU, "fp32" in this course means IEEE float32: ``resolve_device`` turns PyTorch's default TF32
for cuDNN convolutions off (``common.precision.set_fp32_math``), so fp32 baselines are not a TF32 hybrid.
Scripts that measure TF32 (Lab-03's ``tf32`` rows, ``pytorch_basics.py --precision tf32``) turn it
on where they measure it, and every record says which was in force (``provenance.fp32_math``).

**Test mode: processes sharing a GPU.** ``HPC_DL_LABS_SHARE_GPUS=1`` lets more processes than GPUs
run on a node: local rank ``r`` takes GPU ``r % count`` and the process group uses Gloo (NCCL
refuses two ranks on one GPU), so a machine with one GPU can run a 2-rank job and catch what one
rank cannot (a tensor left on the CPU beside CUDA tensors, a rank-dependent device). It proves
placement, not speed or NCCL: never set it for a measurement (``scripts/gpu_proof.sh`` sets it
for its ``*_shared_gpu`` checks).

``resolve_device`` also starts CUDA on this process's GPU (``set_device`` and ``init``), so the
memory counters of ``common.measure.timing`` are live from the first step, whatever the script calls first.
"""

from __future__ import annotations

import os
import random

import torch

from common.precision import set_fp32_math
from common.errors import UserError


#: The variable that turns on the shared-GPU test mode (see the module docstring).
SHARE_GPUS_VARIABLE = "HPC_DL_LABS_SHARE_GPUS"


def sharing_gpus() -> bool:
    """True in the test mode where several processes may share one GPU over Gloo."""
    return os.environ.get(SHARE_GPUS_VARIABLE, "") == "1"


def device_type(name: str = "auto") -> str:
    """``cuda`` or ``cpu``: the kind of device ``--device NAME`` asks for, without starting CUDA. The
    course's one rule for ``auto``: the GPU when PyTorch sees one, else the CPU."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name.startswith("cuda") else name


def resolve_device(name: str = "auto", local_rank: int = 0, local_world_size: int | None = None, *,
                   start: bool = True) -> torch.device:
    """Map ``auto|cpu|cuda`` (or ``cuda:N``) to a ``torch.device`` for this process.

    ``local_rank`` picks this process's GPU on a multi-GPU node. ``local_world_size`` (processes on
    this node, when the launcher says) must not exceed the visible GPUs: more processes than GPUs
    is refused on every rank, naming both counts, instead of putting two ranks on one GPU.
    ``start=False`` checks the request and starts nothing on the GPU: for a process that only launches
    the ones that compute, so that it holds no CUDA context (hundreds of MiB) on their GPU 0 while they run.
    """
    name = (name or "auto").strip().lower()
    if device_type(name) == "cpu":
        return torch.device("cpu")
    name = "cuda" if name == "auto" else name
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise UserError(
                f"--device cuda was requested but PyTorch sees no CUDA GPU{hint}; "
                "run on a GPU node, or use --device cpu or --device auto"
            )
        count = torch.cuda.device_count()
        if ":" in name:
            index = int(name.split(":", 1)[1])
            if index >= count:
                raise UserError(f"--device {name}: only {count} GPU(s) visible (cuda:0..cuda:{count - 1})")
        else:
            processes = max(local_world_size or 0, local_rank + 1)
            if sharing_gpus():
                local_rank %= count
            elif processes > count:
                raise UserError(f"{processes} processes on this node but only {count} GPU(s) visible: one GPU per "
                                f"process, so start at most {count} (e.g. torchrun --nproc_per_node={count}), or "
                                "use --device cpu for Gloo processes")
            index = local_rank
        if not start:
            return torch.device("cuda", index)
        set_fp32_math("ieee")  # fp32 means fp32: see the module docstring
        # Start CUDA here, on this process's GPU: CUDA starts lazily, and a first call that is not a
        # tensor operation (torch.cuda.reset_peak_memory_stats) fails with "Invalid device argument"
        # because the caching allocator does not exist yet; the memory counters read 0 until then.
        torch.cuda.set_device(index)
        torch.cuda.init()
        return torch.device("cuda", index)
    raise UserError(f"unknown device {name!r}; choose auto, cpu or cuda")


def pci_bus_id(index: int) -> str | None:
    """The PCI bus id of CUDA device ``index`` as NVML and ``nvidia-smi`` write it (``00000000:1B:00.0``).

    CUDA numbers the visible GPUs fastest first (or as ``CUDA_VISIBLE_DEVICES`` lists them), NVML and
    ``nvidia-smi`` number every GPU of the node in PCI order: the bus id is what both agree on.
    ``None`` where this PyTorch's device properties have no PCI fields.
    """
    props = torch.cuda.get_device_properties(index)
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return None


def normalise_bus_id(text: str) -> str:
    """``00000000:1b:00.0`` and ``0000:1B:00.0`` -> ``0000:1b:00.0``: one spelling to compare bus ids."""
    parts = text.strip().lower().split(":")
    if len(parts) == 2:  # no domain: the first one
        parts = ["0", *parts]
    try:
        return f"{int(parts[-3], 16):04x}:{int(parts[-2], 16):02x}:{parts[-1]}"
    except (ValueError, IndexError):
        return text.strip().lower()


def set_launch_blocking(env: dict[str, str] | None = None) -> None:
    """``CUDA_LAUNCH_BLOCKING=1`` for this process: every CUDA call returns when its kernels are done.

    CUDA reads the variable when it starts, so this must run before anything touches the GPU; once
    CUDA is initialised it is refused with one line (export the variable before Python instead).
    """
    if torch.cuda.is_initialized():
        raise UserError("--launch-blocking must be set before CUDA starts, and CUDA is already running in this "
                        "process; export CUDA_LAUNCH_BLOCKING=1 before starting Python instead")
    (os.environ if env is None else env)["CUDA_LAUNCH_BLOCKING"] = "1"


def set_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (NCCL and ``.cuda()`` calls rely on it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when installed) and PyTorch on every device."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device


def configure_threads(env: dict[str, str] | None = None) -> int:
    """Use the CPUs Slurm gave this task for intra-op threads; return the thread count.

    Without this, PyTorch starts one thread per core of the *node*, and several tasks on one node
    oversubscribe it. An explicit ``OMP_NUM_THREADS`` wins (torchrun sets it to share a task's cores
    among its workers; the job header sets it too); off-cluster the PyTorch default is kept.
    """
    from common.runtime.cpus import allocated_cpus

    env = dict(os.environ) if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit():
        return torch.get_num_threads()
    cpus = allocated_cpus(env)
    if cpus is not None:
        torch.set_num_threads(cpus)
    return torch.get_num_threads()


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so a clock read afterwards measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """A short human-readable name: ``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu (8 threads)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def use_deterministic_algorithms(device: torch.device) -> None:
    """Make a GPU run repeat itself bitwise (what a bitwise resume from a checkpoint needs).

    cuDNN and cuBLAS otherwise may pick algorithms that add in a different order from run to run
    (atomics, autotuning), so two identical runs, or a run and its resumed twin, differ by rounding.
    ``CUBLAS_WORKSPACE_CONFIG`` must be set before the first cuBLAS call; PyTorch warns, naming the
    operation, where one has no deterministic implementation. On a CPU, runs repeat bitwise anyway.
    """
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
