"""One distributed setup and teardown for every script (docs/conventions.md, convention 4).

    ctx = init_distributed(args.device)        # torchrun, srun, or plain python
    try:
        ... train on ctx.device, wrap the model in DDP when ctx.is_distributed ...
    finally:
        teardown_distributed(ctx)

- Backend from the device: NCCL for CUDA, Gloo for CPU.
- Ranks and the rendezvous address come from :func:`common.runtime.launch.detect_launch`: torchrun's
  variables, Slurm's inside ``srun``, or a single process. No fixed port anywhere.
- A plain ``python`` run gets world size 1 and no process group, unless the caller asks for one
  (``force_process_group=True``: then a one-process Gloo/NCCL group on a free local port, so a DDP
  script runs unchanged outside a launcher).
- Never initialises twice: an existing group is reused and left for its owner to destroy.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from common.errors import UserError
from common.runtime.compat import clear_dtensor_caches, set_collective_timeout
from common.runtime.device import (configure_threads, describe, device_type, resolve_device, set_device, sharing_gpus,
                                   use_deterministic_algorithms)
from common.runtime.envcheck import slurm_gpu_count
from common.runtime.launch import LaunchInfo, detect_launch, free_port, local_world_size, rank_tag

__all__ = [
    "DistContext", "backend_for", "init_distributed", "open_process", "teardown_distributed",
    "print0", "print_rank", "all_reduce_sum", "all_reduce_mean", "all_reduce_max", "any_rank", "any_rank_on_host",
    "every_rank_arrives",
    "gather_objects",
    "MODULES_BINDING_THE_WORLD_GROUP",
]


@dataclass
class DistContext:
    """The result of :func:`init_distributed`: who we are, on which device, with which backend."""

    launch: LaunchInfo
    device: torch.device
    backend: str | None = None
    owns_group: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    threads: int = 0  # CPU threads this process computes with (set by open_process)

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

    def line(self, *, distributed: bool) -> str:
        """One line for the start of a run: processes, backend, device, threads."""
        if not distributed:
            return f"device {describe(self.device)} | threads {self.threads}"
        return (f"{self.world_size} process(es), backend {self.backend}, launcher {self.launch.launcher} | "
                f"device {describe(self.device)} (rank 0) | threads {self.threads}")

    def describe(self) -> dict[str, Any]:
        """Provenance for result records."""
        return {"launcher": self.launch.launcher, "backend": self.backend, "rank": self.rank,
                "world_size": self.world_size, "master_addr": self.launch.master_addr,
                "master_port": self.launch.master_port}


#: Modules of torch whose functions take ``group=group.WORLD`` as a default argument. Python evaluates
#: a default once, when the module is first imported: imported while a group exists, such a module
#: holds that group for the rest of the process (``destroy_process_group`` only forgets it), and with it
#: the group's threads. DDP and the optimizers import the first one lazily, after the group exists.
#: So these are imported before the group is created, while their defaults can only be ``None``
#: (``tests/test_distributed_teardown.py`` scans torch for new ones).
MODULES_BINDING_THE_WORLD_GROUP = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors between GPUs; Gloo is the CPU backend. Processes that share a GPU (the
    test mode of :func:`common.runtime.device.sharing_gpus`) use Gloo: NCCL refuses two ranks on one GPU."""
    return "nccl" if device.type == "cuda" and not sharing_gpus() else "gloo"


def _gpus_of_its_own(visible: int) -> bool:
    """True where srun gave this task GPUs of its own, which it sees from ``cuda:0`` on, among ``visible`` GPUs:
    ``--gpus-per-task``, or a binding that left it one of the node's GPUs (``--gpu-bind=closest`` with a GPU
    a socket, ``single:1``, ``map_gpu``). False where it sees as many GPUs as the node has tasks (Slurm's
    default, also ``--gpus-per-task`` with ``--gpu-bind=none``): its GPU is then ``cuda:LOCAL_RANK``."""
    tasks = local_world_size()
    if detect_launch().launcher != "slurm" or tasks is None or not 0 < visible < tasks:
        return False
    if os.environ.get("SLURM_GPUS_PER_TASK", "").strip():
        return True
    on_node, _ = slurm_gpu_count(os.environ)
    return visible == 1 and (on_node or 0) > 1


def init_distributed(device_name: str = "auto", *, force_process_group: bool = False,
                     timeout_s: float | None = None) -> DistContext:
    """Start (or join) the process group this process belongs to and pick its device."""
    launch = detect_launch()
    visible = torch.cuda.device_count() if device_type(device_name) == "cuda" else 0
    if _gpus_of_its_own(visible):  # srun bound this task to its own GPU(s): they are cuda:0..
        device = resolve_device(device_name)
    else:  # more processes on this node than GPUs is one error line here, not "Duplicate GPU" later
        try:
            device = resolve_device(device_name, local_rank=launch.local_rank, local_world_size=local_world_size())
        except UserError as err:
            on_node, _ = slurm_gpu_count(os.environ)
            if not 0 < visible < (on_node or 0):
                raise
            raise UserError(f"{err}. Slurm left this task {visible} of the node's {on_node} GPUs (CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}), shared with other tasks: ask srun for "
                            "--gpus-per-task=1, or --gpu-bind=none") from None
    set_device(device)
    backend = backend_for(device)
    if dist.is_available() and dist.is_initialized():
        return DistContext(launch=launch, device=device, backend=dist.get_backend(), owns_group=False)
    if launch.world_size <= 1 and not force_process_group:
        return DistContext(launch=launch, device=device, backend=None, owns_group=False)

    if launch.launcher == "single":
        launch = LaunchInfo("single", 0, 0, 1, 0, "127.0.0.1", free_port())
    addr, port = launch.master_addr or "127.0.0.1", launch.master_port or free_port()
    # Map Slurm's view onto torchrun's variables once, so any library reading them agrees.
    # Those set here are removed again at teardown, so a later run in this process starts clean.
    added = []
    for key, value in {"RANK": launch.rank, "WORLD_SIZE": launch.world_size,
                       "LOCAL_RANK": launch.local_rank, "MASTER_ADDR": addr, "MASTER_PORT": port}.items():
        if key not in os.environ:
            os.environ[key] = str(value)
            added.append(key)
    # The start-up (rendezvous, first connections) always gets the usual timeout: the ranks reach it
    # seconds apart (imports, a loaded node), which is no hang. A short collective timeout
    # (``--collective-timeout``) is set once every rank is in (common.runtime.compat).
    timeout = _dt.timedelta(seconds=float(os.environ.get("HPC_DL_LABS_DIST_TIMEOUT", 600)))
    for module in MODULES_BINDING_THE_WORLD_GROUP:
        importlib.import_module(module)
    # device_id binds NCCL to this rank's GPU at once, so a bad GPU set-up fails here, not at the first step.
    init_method = f"tcp://{addr}:{port}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt not in ("", "0"):
        # torchrun --max-restarts: the restarted ranks meet in the same store as the attempt before, which
        # still holds that attempt's addresses; a rank that reads one connects to a dead port. Each
        # attempt gets keys of its own.
        store, _, _ = next(dist.rendezvous(f"{init_method}?rank={launch.rank}&world_size={launch.world_size}",
                                           timeout=timeout))
        init_method, store = None, dist.PrefixStore(f"/attempt_{attempt}", store)
    else:
        store = None
    dist.init_process_group(backend=backend, init_method=init_method, store=store, rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    if timeout_s is not None and set_collective_timeout(timeout_s) is None:
        print_rank(f"note: this PyTorch cannot shorten a process group's timeout once it has started; "
                   f"collectives wait {timeout.total_seconds():.0f} s (HPC_DL_LABS_DIST_TIMEOUT), not "
                   f"--collective-timeout {timeout_s:g}")
    launch = LaunchInfo(launch.launcher, launch.rank, launch.local_rank, launch.world_size,
                        launch.node_rank, addr, port)
    return DistContext(launch=launch, device=device, backend=backend, owns_group=True,
                       extra={"environment_set": added, "collective_timeout_s": timeout_s})


def open_process(device_name: str, *, distributed: bool, deterministic: bool = False,
                 collective_timeout_s: float | None = None) -> DistContext:
    """Where this process computes: CPU threads from the allocation, its device, and with
    ``distributed`` the process group (a plain ``python`` run gets a one-process group, so a DDP
    script runs unchanged outside a launcher). Without ``distributed`` no group is created, whatever
    launched the process. ``deterministic``: deterministic GPU algorithms. ``collective_timeout_s``:
    how long a collective waits for its peers before it fails (``--collective-timeout``; ``None``:
    the group's usual timeout)."""
    threads = configure_threads()
    if distributed:
        ctx = init_distributed(device_name, force_process_group=True, timeout_s=collective_timeout_s)
        print_rank(f"device {describe(ctx.device)}")
    else:
        ctx = DistContext(launch=LaunchInfo("single", 0, 0, 1, 0, None, None), device=resolve_device(device_name))
    if deterministic:
        use_deterministic_algorithms(ctx.device)
    ctx.threads = threads
    return ctx


def teardown_distributed(ctx: DistContext | None) -> None:
    """Destroy the process group if this context created it (call it in ``finally``).

    On a normal exit the ranks first meet at a barrier, so none tears its connections down while
    another (rank 0 writing the record, say) still uses them; a barrier that fails because a peer has
    already given up (a script that caught a collective's error and returned its status) is one line,
    not a traceback. When an exception is on its way out, there is no barrier: the other ranks may be
    stuck in a different collective, and waiting for them would turn one rank's error into a hang.

    ``destroy_process_group`` only makes torch forget the group: the group and its threads (Gloo's
    workers and transport loop, the rendezvous store's server, NCCL's watchdog) end when the last
    object holding it goes. Torch's own holders are dealt with here (see
    :data:`MODULES_BINDING_THE_WORLD_GROUP`; a collection frees what waits in reference cycles);
    what the caller still holds (a DDP model holds its group) goes when the caller drops it, at
    the latest when its function returns. A thread of the group still alive when the interpreter
    shuts down can abort the process after main has returned.
    """
    if ctx is not None and ctx.owns_group and dist.is_available() and dist.is_initialized():
        if sys.exc_info()[0] is None:
            try:
                dist.barrier()
            except RuntimeError as error:  # a peer gave up first (its failure was said where it happened)
                message = (str(error).strip().splitlines() or [type(error).__name__])[0]
                print_rank(f"teardown: not every rank reached the final barrier ({message[:160]})", file=sys.stderr)
        _HOST_GROUPS.clear()
        dist.destroy_process_group()
        _forget_dtensor_caches()
        gc.collect()
        for key in ctx.extra.pop("environment_set", []):
            os.environ.pop(key, None)


def _forget_dtensor_caches() -> None:
    """Empty DTensor's global caches (FSDP2 fills them): their keys and plans hold device meshes, and
    a mesh holds its process groups, so a group would outlive ``destroy_process_group`` with its
    threads. (The model itself holds the mesh too; it goes when the script's ``main`` returns.)
    Where those caches are differs between releases: ``common.runtime.compat.clear_dtensor_caches``."""
    if "torch.distributed.tensor" not in sys.modules:  # never used: nothing cached
        return
    clear_dtensor_caches()
    # A mesh still held after that keeps its groups in its own registry: on torch 2.11 DTensor's sharding objects,
    # held where no cache clear reaches, kept Lab-04's and Lab-07's mesh (and Gloo's threads) past the end. No
    # group may be used after destroy_process_group, so every mesh left lets go of them.
    from torch.distributed.device_mesh import DeviceMesh

    # issubclass on each object's type: isinstance would ask objects themselves (torch's deprecated reduce_op warns).
    for mesh in [obj for obj in gc.get_objects() if issubclass(type(obj), DeviceMesh)]:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def _global_rank() -> int:
    """This process's global rank: from the process group once there is one, else from the launcher."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return detect_launch().rank


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (flushed, so Slurm output files stay in order)."""
    if _global_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def print_rank(*args: Any, sep: str = " ", end: str = "\n", file: Any = None, flush: bool = True) -> None:
    """``print`` on every rank, tagged ``[host:rank]``.

    The line is written in one piece: ``print`` writes each argument and the newline separately,
    and the ranks of a job share one output file, so their lines would interleave mid-line.
    """
    file = sys.stdout if file is None else file
    file.write(sep.join(map(str, (rank_tag(), *args))) + end)
    if flush:
        file.flush()


def _reduce(value: Any, op: str, device: torch.device | None) -> Any:
    """Reduce a number, or a list of numbers element-wise, over all ranks in one all-reduce.

    ``op`` is ``sum``, ``max`` or ``mean``. A number (or a one-element tensor) comes back as a
    ``float``; a list (or a larger tensor) as a list of floats. Not distributed, the value comes
    back as it was, in that form. float64 throughout: sums of many float32 losses lose digits, and
    counts stay exact up to 2**53. ``device`` is where the reduction happens: the process's GPU
    with NCCL (which cannot reduce CPU tensors), the CPU with Gloo.
    """
    if isinstance(value, torch.Tensor):
        is_list = value.numel() != 1
        tensor = value.detach().reshape(-1).to(device or value.device, torch.float64, copy=True)
    else:
        is_list = isinstance(value, (list, tuple))
        tensor = torch.tensor(value if is_list else [value], dtype=torch.float64, device=device)
    if tensor.numel() and dist.is_available() and dist.is_initialized():
        # Gloo has no AVG: a mean is a sum divided by the world size.
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            tensor /= dist.get_world_size()
    values = tensor.tolist()
    return values if is_list else values[0]


def all_reduce_sum(value: torch.Tensor | float | list[float], device: torch.device | None = None) -> Any:
    """The sum over all ranks of a number, or element-wise of a list (e.g. loss sums and sample counts)."""
    return _reduce(value, "sum", device)


def all_reduce_mean(value: torch.Tensor | float | list[float], device: torch.device | None = None) -> Any:
    """The mean over all ranks of a number, or element-wise of a list (e.g. each step's loss).

    Each rank's loss is the mean over its share of the global batch; with equal shares, the mean
    of the ranks' losses is the loss over the global batch.
    """
    return _reduce(value, "mean", device)


def all_reduce_max(value: torch.Tensor | float | list[float], device: torch.device | None = None) -> Any:
    """The largest over all ranks of a number, or element-wise of a list (e.g. each timed call's slowest rank)."""
    return _reduce(value, "max", device)


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when ``flag`` is true on at least one (e.g. a stop signal arrived).

    Ranks must agree before they stop: a rank that leaves the loop alone leaves its peers waiting
    in the next all-reduce until the timeout.
    """
    return bool(_reduce(1.0 if flag else 0.0, "max", device))


def _host_group() -> Any:
    """A Gloo group for agreements between the CPUs: the world on a Gloo run; on NCCL a Gloo group beside
    it, made on first use (every rank reaches that first use at the same point, so they make it together)."""
    if dist.get_backend() == "gloo":
        return None
    group = _HOST_GROUPS.get(id(dist.group.WORLD))
    if group is None:
        group = _HOST_GROUPS[id(dist.group.WORLD)] = dist.new_group(backend="gloo")
    return group


#: The Gloo group beside a NCCL world, by the world group's id (forgotten at teardown).
_HOST_GROUPS: dict[int, Any] = {}


def any_rank_on_host(flag: bool) -> bool:
    """:func:`any_rank` agreed between the CPUs: a one-number all-reduce over Gloo (the world group on
    CPU runs; a Gloo group beside NCCL's on GPU runs), so a per-step check never waits for the GPU's
    queued work the way a CUDA tensor's ``.item()`` would."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_host_group())
    return bool(value.item())


def every_rank_arrives(what: str, ctx: DistContext) -> None:
    """Wait until every rank has reached ``what``, a collective call. A rank that never does (the call made
    under ``if rank == 0:``) ends the wait within the collective timeout with one line naming the ranks
    that did not come (Gloo's ``monitored_barrier``), where the collective itself would hang."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    seconds = float(ctx.extra.get("collective_timeout_s") or os.environ.get("HPC_DL_LABS_DIST_TIMEOUT", 600))
    try:
        dist.monitored_barrier(group=_host_group(), timeout=_dt.timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as error:
        found = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{what} is collective: every rank must call it, and not all did within {seconds:g} s "
                        f"(called under `if run.is_main:`?): {found}") from None


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
