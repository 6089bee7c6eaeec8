"""Choosing the device, seeding, and CPU thread settings.

``resolve_device("auto")`` gives the GPU of this process when one is visible and the CPU otherwise,
so the same script runs on a laptop, a CI runner and a GPU node unchanged. Asking for ``cuda`` on a
machine without a GPU is a :class:`~common.errors.UserError` (one line, non-zero exit), not a
CUDA traceback deep inside the first ``.to()``.
"""

from __future__ import annotations

import os
import random

import torch

from common.errors import UserError


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """Map ``auto|cpu|cuda`` (or ``cuda:N``) to a ``torch.device`` for this process.

    ``local_rank`` picks this process's GPU on a multi-GPU node (modulo the visible count, so
    oversubscribed runs still start).
    """
    name = (name or "auto").strip().lower()
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cpu":
            return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise UserError(
                f"--device cuda was requested but PyTorch sees no CUDA GPU{hint}; "
                "run on a GPU node, or use --device cpu or --device auto"
            )
        count = torch.cuda.device_count()
        index = int(name.split(":", 1)[1]) if ":" in name else local_rank % count
        if index >= count:
            raise UserError(f"--device {name}: only {count} GPU(s) visible (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", index)
    raise UserError(f"unknown device {name!r}; choose auto, cpu or cuda")


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
    from common.cli import allocated_cpus

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
