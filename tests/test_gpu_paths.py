"""The CUDA-only paths of the course, tested on a CPU: PyTorch is made to report GPUs (monkeypatched
``torch.cuda.*``), ``nvidia-smi`` is a fake on the PATH, an old PyTorch is a stub package. Nothing
runs on those fake GPUs; what is tested is every decision the code makes from what they report.
The ``gpu``-marked tests at the end check on a real GPU what a CPU cannot show.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from types import SimpleNamespace

import pytest

from helpers import PYTHON, REPO, fake_torch, load_script, run_main, script_env

H100 = "NVIDIA H100 80GB HBM3"
V100 = "Tesla V100-SXM2-32GB"


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(count, capability, name, bus_ids)``: PyTorch reports these CUDA GPUs.

    Also restores the float32-maths settings afterwards, which code under test may change.
    """
    import torch

    backends = torch.backends
    levels = (backends.cuda.matmul, backends.cudnn, backends.cudnn.conv, backends.cudnn.rnn)
    before = [level.fp32_precision for level in levels]
    legacy_before = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)

    def install(count: int = 2, capability: tuple[int, int] = (9, 0), name: str = H100,
                bus_ids: list[int] | None = None, free_total: tuple[int, int] = (70 * 2**30, 80 * 2**30)) -> None:
        buses = bus_ids or [0x18 + 0x10 * i for i in range(count)]
        props = [SimpleNamespace(name=name, major=capability[0], minor=capability[1], total_memory=free_total[1],
                                 multi_processor_count=132, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0)
                 for bus in buses]
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: count)
        monkeypatch.setattr(cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(cuda, "get_device_properties",
                            lambda index: props[int(getattr(index, "index", index) or 0)])
        monkeypatch.setattr(cuda, "is_bf16_supported", lambda *args, **kwargs: True)  # emulation says yes
        # Like a real GPU, CUDA starts on the first real CUDA call (torch.cuda.init, set_device, a
        # tensor op): before that the allocator's counters read 0 and resetting them raises.
        started = {"cuda": False}

        def start(*args, **kwargs) -> None:
            started["cuda"] = True

        def reset_peak_memory_stats(device=None) -> None:
            if not started["cuda"]:
                raise RuntimeError("Invalid device argument : did you call init?")

        monkeypatch.setattr(cuda, "init", start)
        monkeypatch.setattr(cuda, "set_device", start)
        monkeypatch.setattr(cuda, "is_initialized", lambda: started["cuda"])
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: free_total)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 3 * 2**30 if started["cuda"] else 0)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: 4 * 2**30 if started["cuda"] else 0)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
        monkeypatch.setattr(cuda, "can_device_access_peer", lambda i, j: True)

    yield install
    backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = legacy_before
    for level, value in zip(levels, before):
        level.fp32_precision = value


@pytest.fixture
def launch_env(monkeypatch):
    """``launch_env(**variables)``: exactly these launcher variables in ``os.environ``.

    The torchrun variables are restored afterwards even where the code under test sets them
    (``init_distributed`` maps Slurm's variables onto torchrun's with ``os.environ.setdefault``).
    """
    def install(**variables: str) -> None:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.setenv(key, "")  # remembered, so the undo removes what the test leaves
        for key in list(os.environ):
            if key.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_RANK")):
                monkeypatch.delenv(key)
        for key, value in variables.items():
            monkeypatch.setenv(key, value)
    return install


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# --------------------------------------------------------------------------------------------
# bf16 below compute capability 8.0


def test_bf16_is_refused_below_compute_capability_8_although_is_bf16_supported_says_yes(fake_gpus):
    import torch

    from common.train import amp
    from common.errors import UserError

    cuda = torch.device("cuda", 0)
    fake_gpus(capability=(7, 0), name=V100)
    with pytest.raises(UserError) as refused:
        amp.check_precision("bf16", cuda)
    assert "V100" in str(refused.value) and "7.0" in str(refused.value) and "--precision fp16" in str(refused.value)
    assert amp.check_precision("fp16", cuda) == "fp16"
    fake_gpus(capability=(8, 0), name="NVIDIA A100-SXM4-40GB")
    assert amp.check_precision("bf16", cuda) == "bf16"


def test_mnist_training_with_bf16_on_a_v100_is_one_error_line(fake_gpus, tmp_path, capsys):
    fake_gpus(count=1, capability=(7, 0), name=V100)
    status = run_main("chapters/ch04_deep_learning/mnist_training.py",
                      ["--device", "cuda", "--precision", "bf16", "--dry-run", "--results-dir", str(tmp_path / "r")])
    assert status == 2 and "no bf16 tensor cores" in one_error_line(capsys)
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------------------------
# more processes than GPUs; NCCL bound to its GPU at init


def test_more_processes_on_a_node_than_gpus_is_refused_naming_both_counts(fake_gpus):
    from common.runtime.device import resolve_device
    from common.errors import UserError

    fake_gpus(count=2)
    assert str(resolve_device("cuda", local_rank=1, local_world_size=2)) == "cuda:1"
    with pytest.raises(UserError, match=r"^3 processes on this node but only 2 GPU\(s\) visible"):
        resolve_device("cuda", local_rank=2)  # was cuda:0, a second rank on GPU 0
    with pytest.raises(UserError, match=r"^4 processes on this node but only 2 GPU\(s\) visible"):
        resolve_device("auto", local_rank=0, local_world_size=4)  # rank 0 refuses too, not only the extra ones


def test_a_launching_process_checks_the_gpus_without_starting_cuda_on_them(fake_gpus):
    """start=False (Lab-03's -g, Lab-09's local sweep: a process that only starts the ones that compute) refuses
    as the ranks would, and holds no CUDA context on GPU 0 while they run."""
    import torch

    from common.errors import UserError
    from common.runtime.device import resolve_device

    fake_gpus(count=2)
    assert str(resolve_device("cuda", local_world_size=2, start=False)) == "cuda:0"
    with pytest.raises(UserError, match=r"^3 processes on this node but only 2 GPU\(s\) visible"):
        resolve_device("cuda", local_world_size=3, start=False)
    assert not torch.cuda.is_initialized()
    assert str(resolve_device("cuda", local_world_size=2)) == "cuda:0" and torch.cuda.is_initialized()


def test_lab02s_sweep_checks_its_steps_on_the_gpu_without_starting_cuda(fake_gpus):
    """sweep.py only starts kernprof for each step: a CUDA context of its own would sit on the GPU beside every
    step's (and in the whole-GPU memory figure a step records when NVML cannot name its process)."""
    import torch

    from common.errors import UserError
    from helpers import load_script

    sweep = load_script("labs/lab02_profiling/sweep.py")
    fake_gpus(count=1, capability=(7, 0), name="Tesla V100-SXM2-16GB")
    step = SimpleNamespace(name="amp")
    sweep.preflight([(step, ["--device", "cuda", "--precision", "fp16"])])
    with pytest.raises(UserError, match=r"^step amp: .*bf16"):
        sweep.preflight([(step, ["--device", "cuda", "--precision", "bf16"])])
    assert not torch.cuda.is_initialized()


def test_init_distributed_refuses_on_every_rank_when_torchrun_starts_more_processes_than_gpus(
        fake_gpus, launch_env, monkeypatch):
    import torch.distributed as dist

    from common.runtime.distributed import init_distributed
    from common.errors import UserError

    fake_gpus(count=2)
    launch_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29500")
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: started.append(kwargs))
    with pytest.raises(UserError, match=r"3 processes on this node but only 2 GPU\(s\) visible"):
        init_distributed("cuda")
    assert started == []


def test_nccl_is_given_its_device_at_init(fake_gpus, launch_env, monkeypatch):
    import torch
    import torch.distributed as dist

    from common.runtime.distributed import init_distributed

    fake_gpus(count=2)
    launch_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29500")
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: started.append(kwargs))
    ctx = init_distributed("cuda")
    assert ctx.device == torch.device("cuda", 1)
    (kwargs,) = started
    assert kwargs["backend"] == "nccl" and kwargs["device_id"] == torch.device("cuda", 1)


def test_sharing_gpus_is_a_test_mode_that_puts_two_ranks_on_one_gpu_over_gloo(fake_gpus, launch_env, monkeypatch):
    """HPC_DL_LABS_SHARE_GPUS=1: rank 1 of 2 on a one-GPU machine takes GPU 0 and the group is Gloo
    (NCCL refuses two ranks on one GPU), and no device_id is given to a Gloo group."""
    import torch
    import torch.distributed as dist

    from common.runtime.distributed import init_distributed

    fake_gpus(count=1)
    launch_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29500")
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: started.append(kwargs))
    monkeypatch.setenv("HPC_DL_LABS_SHARE_GPUS", "1")
    ctx = init_distributed("cuda")
    assert ctx.device == torch.device("cuda", 0) and ctx.backend == "gloo"
    (kwargs,) = started
    assert kwargs["backend"] == "gloo" and kwargs["device_id"] is None
    monkeypatch.delenv("HPC_DL_LABS_SHARE_GPUS")
    from common.errors import UserError

    with pytest.raises(UserError, match=r"^2 processes on this node but only 1 GPU\(s\) visible"):
        init_distributed("cuda")


def test_srun_with_gpus_per_task_gives_each_task_its_own_gpu(fake_gpus, launch_env, monkeypatch):
    import torch
    import torch.distributed as dist

    from common.runtime.distributed import init_distributed
    from common.runtime.launch import local_world_size

    fake_gpus(count=1)  # srun --gpus-per-task=1: every task sees one GPU, its own
    launch_env(SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_LOCALID="3", SLURM_NODEID="0",
               SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="4", SLURM_STEP_NODELIST="gpu01",
               SLURM_GPUS_PER_TASK="1")
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    assert init_distributed("cuda").device == torch.device("cuda", 0)
    assert local_world_size({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NODEID": "3",
                             "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}) == 1
    assert local_world_size({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == 4


@pytest.mark.parametrize("visible, variables, expected", [
    # --gpu-bind=closest (a GPU a socket), single:1 or map_gpu: task 2 of 4 sees one GPU of the node's four.
    (1, {"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "2"}, "cuda:0"),
    # --gpus-per-task=1 with --gpu-bind=none: every task sees every GPU, so its own is its local rank's.
    (4, {"SLURM_GPUS_PER_TASK": "1", "SLURM_GPUS_ON_NODE": "4"}, "cuda:2"),
    # Slurm's default: every task sees every GPU of the node.
    (4, {"SLURM_GPUS_ON_NODE": "4"}, "cuda:2"),
    # closest with two GPUs a socket: tasks 2 and 3 both see the same two, and which is whose is not said.
    (2, {"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "2,3"},
     r"4 processes on this node but only 2 GPU\(s\) visible: .* Slurm left this task 2 of the node's 4 GPUs "
     r"\(CUDA_VISIBLE_DEVICES=2,3\), shared with other tasks: ask srun for --gpus-per-task=1, or --gpu-bind=none$"),
])
def test_srun_s_gpu_bindings_give_each_task_a_gpu_of_its_own_or_one_line(fake_gpus, launch_env, monkeypatch,
                                                                        visible, variables, expected):
    """Lab-05's README and the placement check advise --gpu-bind=closest: with one GPU a task left, every task
    refused ("4 processes on this node but only 1 GPU(s) visible"); with --gpus-per-task and --gpu-bind=none
    every task took cuda:0 (NCCL's "Duplicate GPU")."""
    import torch.distributed as dist

    from common.errors import UserError
    from common.runtime.distributed import init_distributed

    monkeypatch.delenv("HPC_DL_LABS_SHARE_GPUS", raising=False)
    fake_gpus(count=visible)
    launch_env(SLURM_JOB_ID="78", SLURM_STEP_ID="0", SLURM_PROCID="2", SLURM_LOCALID="2", SLURM_NODEID="0",
               SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="4", SLURM_STEP_NODELIST="gpu01", **variables)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    if expected.startswith("cuda"):
        assert str(init_distributed("cuda").device) == expected
    else:
        with pytest.raises(UserError, match=expected):
            init_distributed("cuda")


# --------------------------------------------------------------------------------------------
# fp32 means fp32, and every record says which maths was in force


def test_a_cuda_run_uses_real_fp32_and_records_say_which_maths_was_in_force(fake_gpus):
    import torch

    from common.precision import fp32_math, set_fp32_math
    from common.runtime.device import resolve_device
    from common.results import provenance

    fake_gpus(count=1)
    set_fp32_math("tf32")  # what a previous tf32 measurement (or PyTorch's default for convolutions) leaves
    assert fp32_math() == {"matmul": "tf32", "cudnn_conv": "tf32"}
    resolve_device("cuda")
    assert fp32_math() == {"matmul": "ieee", "cudnn_conv": "ieee"}
    assert provenance(torch.device("cpu"))["fp32_math"] == {"matmul": "ieee", "cudnn_conv": "ieee",
                                                            "tf32_hardware": False}
    set_fp32_math("tf32")
    assert provenance(torch.device("cuda", 0))["fp32_math"] == {"matmul": "tf32", "cudnn_conv": "tf32",
                                                                "tf32_hardware": True}


def test_legacy_tf32_readers_work_and_agree_with_the_record_after_the_maths_is_set(fake_gpus):
    import torch

    from common.precision import fp32_math, set_fp32_math

    fake_gpus(count=1)
    for mode, matmul_precision in (("tf32", "high"), ("ieee", "highest")):
        torch.set_float32_matmul_precision("high")  # what a library may have done first (it sets oneDNN's level too)
        set_fp32_math(mode)
        # code outside the course (and older lessons) still reads the old flags: they must not raise
        assert torch.backends.cuda.matmul.allow_tf32 is (mode == "tf32")
        assert torch.backends.cudnn.allow_tf32 is (mode == "tf32")
        assert torch.get_float32_matmul_precision() == matmul_precision
        assert fp32_math() == {"matmul": mode, "cudnn_conv": mode}


def test_memory_helpers_before_cuda_starts_say_not_measured_and_resolving_the_device_starts_it(fake_gpus):
    import torch

    from common.runtime.device import resolve_device
    from common.measure.timing import peak_memory, reset_peak_memory

    fake_gpus(count=1)
    gpu = torch.device("cuda", 0)
    reset_peak_memory(gpu)  # CUDA not started: resetting the allocator's peak would raise
    entry = peak_memory(gpu)
    assert entry["peak_bytes"] is None and "not started" in entry["source"]  # not a 0 that looks measured
    assert resolve_device("cuda") == gpu and torch.cuda.is_initialized()
    reset_peak_memory(gpu)
    assert (peak_memory(gpu)["peak_bytes"], peak_memory(gpu)["source"]) == (3 * 2**30, "cuda_max_memory_allocated")


# --------------------------------------------------------------------------------------------
# cudnn.benchmark off and on, both timed after a warm-up


def test_cudnn_benchmark_comparison_warms_up_before_the_first_timed_step(monkeypatch):
    import torch

    import common.models

    loading = load_script("chapters/ch16_gpu_distributed/efficient_loading.py")
    tiny = lambda name, num_classes: torch.nn.Sequential(  # noqa: E731 - the order of steps is tested, not ResNet
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, num_classes))
    monkeypatch.setattr(common.models, "build_model", tiny)
    events = []
    step = loading.training_step_ce
    monkeypatch.setattr(loading, "training_step_ce",
                        lambda *args: (events.append(f"step benchmark={torch.backends.cudnn.benchmark}"), step(*args)))
    clock = loading.time.perf_counter
    monkeypatch.setattr(loading, "time", SimpleNamespace(perf_counter=lambda: (events.append("clock"), clock())[1]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    rows = loading.cudnn_benchmark(torch.device("cpu"), batch_size=2, steps=1)
    assert [row["cudnn_benchmark"] for row in rows] == [False, True]
    assert events[0] == "step benchmark=False" and events.index("clock") > 0  # untimed warm-up first


# --------------------------------------------------------------------------------------------
# Lab-03 --compile resets dynamo per configuration and records whether it compiled


def test_lab03_compile_resets_dynamo_per_configuration_and_records_whether_it_compiled(tmp_path, monkeypatch):
    import functools

    import torch
    import torch._dynamo  # already imported with torchvision, which uses it

    from torch._dynamo.utils import counters

    from common.runtime.distributed import DistContext
    from common.runtime.launch import LaunchInfo
    from labs.lab03_precision_benchmark.lab03_shared import compile_outcome, read_args

    bench = load_script("labs/lab03_precision_benchmark/benchmark_models.py")
    # The eager backend: dynamo captures graphs (what is checked) without a C++ compiler (what CI lacks).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    # A recompile limit of 1: every configuration after the first would be a recompilation past it.
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    cpu = torch.device("cpu")
    args = read_args(bench.build_parser(), ["--device", "cpu", "--compile", "-w", "1", "-n", "1", "--models",
                                            "resnet18", "--results-dir", str(tmp_path),
                                            "--folder", str(tmp_path / "csv")])
    base = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 10))
    images, labels = torch.randn(2, 3, 8, 8), torch.tensor([1, 2])
    outcomes = [bench.time_mode("inference", base, images, labels, precision, cpu, args, False)[2]
                for precision in ("fp32", "fp64")]
    assert [o["compiled"] for o in outcomes] == [True, True] and outcomes[1]["graphs"] >= 1

    for dtype in (torch.float32, torch.float64):  # no reset in between: the second is past the limit
        compiled = torch.compile(bench.make_model(base, "fp32", cpu, False).to(dtype))
        compiled(images.to(dtype))
    missed = compile_outcome(counters)
    assert missed["compiled"] is False and missed["recompile_limit_hits"] >= 1
    ctx = DistContext(launch=LaunchInfo("single", 0, 0, 1, 0, None, None), device=cpu)
    timer, memory, _ = bench.time_mode("inference", base, images, labels, "fp32", cpu, args, False)
    check = {**bench.compare_losses([2.3], [2.3]), "scaler_skipped_steps": 0}
    bench.Output(args, ctx).measured("resnet18", "inference", "fp32", timer, memory, check, 10**6, missed)
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["metrics"]["compile"] == missed
    assert any(note.startswith("NOT COMPILED") and "eager" in note for note in record["notes"])
    # Older releases call the limit cache_size_limit: such a hit is counted too, other give-ups are not.
    older = {"stats": {"unique_graphs": 2}, "unimplemented": {"cache_size_limit reached": 1, "call_function": 3}}
    assert compile_outcome(older) == {"compiled": False, "graphs": 2, "recompile_limit_hits": 1}


# --------------------------------------------------------------------------------------------
# device-level memory beside the allocator's peak, each with its source


def test_peak_memory_on_a_gpu_adds_what_the_device_has_in_use(fake_gpus, monkeypatch):
    import torch

    from common.measure.timing import peak_memory

    fake_gpus(count=1, free_total=(70 * 2**30, 80 * 2**30))
    torch.cuda.init()  # as resolve_device does
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: cudaMemGetInfo for the whole GPU
    entry = peak_memory(torch.device("cuda", 0))
    assert (entry["peak_bytes"], entry["source"]) == (3 * 2**30, "cuda_max_memory_allocated")
    assert (entry["device_used_bytes"], entry["device_used_source"]) == (10 * 2**30, "cuda_mem_get_info")

    class FakeNvml(SimpleNamespace):  # nvidia-ml-py: this process's own use, found by PCI bus id
        NVMLError = RuntimeError

    handles = []
    nvml = FakeNvml(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                    nvmlDeviceGetHandleByPciBusId=lambda bus: handles.append(bus) or "handle",
                    nvmlDeviceGetComputeRunningProcesses=lambda handle: [
                        SimpleNamespace(pid=1, usedGpuMemory=1),
                        SimpleNamespace(pid=os.getpid(), usedGpuMemory=5 * 2**30)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    entry = peak_memory(torch.device("cuda", 0))
    assert (entry["device_used_bytes"], entry["device_used_source"]) == (5 * 2**30, "nvml_process_used")
    assert handles == ["00000000:18:00.0"]


def test_report_shows_device_memory_next_to_the_allocator_peak_with_each_source():
    from common.results import make_record
    from common.report.core import summary_section
    from common.report.runs import runs_frame

    def record(method, world, used):
        memory = [{"device": f"cuda:{i}", "peak_bytes": 2**30, "source": "cuda_max_memory_allocated",
                   "device_used_bytes": used, "device_used_source": "cuda_mem_get_info"} for i in range(world)]
        return make_record(lab="lab01", script="x.py", method=method, config={"model": "m"},
                           metrics={"memory": memory, "world_size": world, "samples_per_s": 10.0},
                           provenance={"hostname": "h", "device": {"type": "cuda", "name": H100}})

    table = summary_section(runs_frame([record("baseline", 1, 3 * 2**30), record("ddp", 2, 5 * 2**30)])).tables[0]
    peak, used = table.columns.index("peak memory per device"), table.columns.index("GPU memory in use per device")
    assert used == peak + 1
    ddp = next(row for row in table.rows if row[used].text.startswith("5.0 / 5.0"))
    assert "CUDA peak allocated" in ddp[peak].title and "cudaMemGetInfo" in ddp[used].title


# --------------------------------------------------------------------------------------------
# nvidia-smi's GPU numbers matched to PyTorch's by PCI bus id


TOPOLOGY = ("\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\n"
            "GPU0\t X \tNV12\tSYS\tSYS\t0-31\n"
            "GPU1\tNV12\t X \tSYS\tSYS\t0-31\n"
            "GPU2\tSYS\tSYS\t X \tNV12\t32-63\n"
            "GPU3\tSYS\tSYS\tNV12\t X \t32-63\n")
BUS_IDS = "0, 00000000:18:00.0\n1, 00000000:3B:00.0\n2, 00000000:86:00.0\n3, 00000000:AF:00.0\n"


@pytest.mark.parametrize("name, capability, native", [(H100, (9, 0), True), (V100, (7, 0), False)])
def test_the_environment_describes_each_gpu_with_its_bf16_support_and_datasheet_peaks(fake_gpus, name, capability,
                                                                                       native):
    """What the environment check (and every record's provenance) says of a GPU: read from PyTorch's device
    properties, the capability deciding native bf16 and the name the datasheet peaks (common.precision)."""
    from common.runtime.envcheck import collect_environment

    fake_gpus(count=2, capability=capability, name=name)
    gpus = collect_environment(smoke_test=False)["gpus"]
    assert [(gpu["index"], gpu["name"], gpu["capability"]) for gpu in gpus] == [(0, name, f"{capability[0]}.0"),
                                                                                 (1, name, f"{capability[0]}.0")]
    assert all(gpu["bf16_native"] is native for gpu in gpus)
    assert gpus[0]["peak_tflops"] and gpus[0]["peak_tflops"]["fp32"] > 0  # the datasheet's figures, not empty


def test_environment_check_matches_topology_to_cuda_devices_by_pci_bus_id(fake_gpus, tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in\n  topo) printf '{TOPOLOGY}' ;;\n  *) printf '{BUS_IDS}' ;;\nesac\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    # CUDA_VISIBLE_DEVICES=3,2 on a node whose GPU pairs 0-1 and 2-3 are NVLinked: cuda:0 is GPU3.
    fake_gpus(count=2, bus_ids=[0xAF, 0x86])
    env_check = load_script("labs/lab01_dp_vs_ddp/01_environment_check.py")
    checks = env_check.multi_gpu_checks({"torch_gpus": 2}, run_backend_tests=False)
    assert [(row["cuda"], row["topology_name"]) for row in checks["cuda_to_topology"]] == [(0, "GPU3"), (1, "GPU2")]
    assert checks["cuda_links"] == [[None, "NV12"], ["NV12", None]]
    text = env_check.format_checks(checks, env_check.lab_warnings({"torch_gpus": 2}, checks))
    assert "cuda:0 = GPU3 (00000000:AF:00.0)" in text and "yes NV12" in text and "WARNING" not in text
    fake_gpus(count=2, bus_ids=[0xAF, 0x99])  # a GPU nvidia-smi does not list: said, not guessed
    checks = env_check.multi_gpu_checks({"torch_gpus": 2}, run_backend_tests=False)
    assert any("cuda:1 could not be matched" in w for w in env_check.lab_warnings({"torch_gpus": 2}, checks))


# --------------------------------------------------------------------------------------------
# Lab-02's synchronised line profile


def test_launch_blocking_is_set_before_cuda_starts_and_refused_after(monkeypatch, tmp_path):
    import torch

    from common.runtime.device import set_launch_blocking
    from common.errors import UserError

    env: dict[str, str] = {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    set_launch_blocking(env)
    assert env == {"CUDA_LAUNCH_BLOCKING": "1"}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(UserError, match="export CUDA_LAUNCH_BLOCKING=1"):
        set_launch_blocking({})

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the flag sets the variable for this process
    status = run_main("labs/lab02_profiling/mnist_classify.py",
                      ["--device", "cpu", "--dataset", "synthetic", "--synthetic-size", "64", "--batch-size", "32",
                       "--test-batch-size", "64", "--epochs", "1", "--num-workers", "0", "--pipeline", "tensor",
                       "--launch-blocking", "--results-dir", str(tmp_path)])
    assert status == 0 and os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["config"]["launch_blocking"] is True
    assert any("changes nothing on a CPU" in note for note in record["notes"])


# --------------------------------------------------------------------------------------------
# run_lab.sh gives DataParallel and DDP the same GPUs


@pytest.mark.parametrize("nproc, gpus, expected", [("2", 1, 2), ("", 1, 1), ("", 4, 2)])
def test_run_lab_gives_dataparallel_the_gpus_ddp_uses(tmp_path, nproc, gpus, expected):
    """DataParallel gets the GPUs of DDP's processes; without LAB01_NPROC a machine with one GPU runs one (two
    were refused at step 3, after the baseline)."""
    log = tmp_path / "calls.log"
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n"
                           f"case \"$2\" in *device_count*) echo {gpus} ;; *device_type*) echo cuda ;; esac\n")
    fake_python.chmod(0o755)
    env = script_env(PYTHON=str(fake_python), LAB01_DEVICE="auto", LAB01_NPROC=nproc, LAB01_GLOBAL_BATCH="8")
    proc = subprocess.run(["bash", str(REPO / "labs/lab01_dp_vs_ddp/run_lab.sh"), str(tmp_path / "r")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    dp = next(line for line in calls if "03_dataparallel_training.py" in line)
    ddp = next(line for line in calls if "04_ddp_training.py" in line)
    assert f"--gpus {','.join(map(str, range(expected)))}" in dp and "--device cuda" in dp
    assert f"--nproc_per_node={expected}" in ddp and "--device cuda" in ddp
    assert f"--batch-size {8 // expected}" in ddp


# --------------------------------------------------------------------------------------------
# one datasheet table (common.precision), read under every lab's names


@pytest.mark.parametrize(("name", "precision", "expected"), [
    ("NVIDIA A100-SXM4-40GB", "fp32", (19.5, "A100 datasheet, fp32, dense")),
    ("NVIDIA A100 80GB PCIe", "amp-bf16", (312.0, "A100 datasheet, bf16, dense")),
    ("NVIDIA H100 PCIe", "tf32", (378.0, "H100 PCIe datasheet, tf32, dense")),
    (H100, "tf32", (494.5, "H100 SXM datasheet, tf32, dense")),
    ("Tesla V100-SXM3-32GB", "half", (125.0, "V100 SXM2 datasheet, fp16, dense")),
    ("Tesla V100-SXM2-32GB", "tf32", (None, "the V100 SXM2 datasheet lists no tf32 peak")),
    ("NVIDIA GeForce RTX 4090", "fp32", (None, "no datasheet peak for 'NVIDIA GeForce RTX 4090' in "
                                               "common.precision.GPU_PEAKS")),
    (None, "fp32", (None, "no peak known for a CPU (it depends on cores, clock and vector units)")),
])
def test_every_lab_reads_one_peak_table_under_its_own_precision_names(name, precision, expected):
    from common import precision as precisions

    assert precisions.peak_of(name, precisions.math_of(precision)) == expected


def test_the_utilisation_of_a_run_is_one_set_of_keys_on_a_gpu_and_on_a_cpu(fake_gpus):
    import torch

    from common import precision

    fake_gpus(count=1)
    speed = precision.utilisation(400e12, torch.device("cuda", 0), "bf16", devices=2)
    assert speed == {"achieved_tflops": 200.0, "peak_tflops": 989.5, "peak_precision": "bf16",
                     "peak_source": "H100 SXM datasheet, bf16, dense", "mfu": 200.0 / 989.5, "mfu_reason": None}
    cpu = precision.utilisation(1e9, torch.device("cpu"), "fp32")
    assert cpu["mfu"] is None and cpu["mfu_reason"].startswith("no peak known for a CPU")
    assert cpu["achieved_tflops"] == 1e-3


def test_an_h100_nvl_gets_the_nvl_peaks_not_the_sxm_ones():
    label, peaks = load_script("chapters/ch04_deep_learning/pytorch_basics.py").peak_for("NVIDIA H100 NVL")
    assert "H100 NVL" in label and peaks["fp32"] == 60 and peaks["bf16"] == 835.5


# --------------------------------------------------------------------------------------------
# each rank saves and restores its own GPU's generator


def test_rng_state_keeps_only_this_ranks_gpu_and_restores_where_fewer_gpus_are_visible(monkeypatch):
    """Rank 3 of a 4-GPU node saves cuda:3's generator alone; resumed where each rank sees one GPU
    (srun --gpus-per-task), it restores that state into cuda:0. Rank 0's ``get_rng_state_all()``
    restored on every rank raised an IndexError there."""
    import torch

    from common.checkpoint.single_file import capture_rng_state, restore_rng_state

    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", str(device))) or "gen3")
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", state, str(device))))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state was read"))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every GPU's state was set"))
    state = capture_rng_state(torch.device("cuda", 3))
    assert state["cuda"] == "gen3" and calls == [("get", "cuda:3")]
    expected = torch.rand(3)  # the CPU generators come back too: the same draws after the restore
    restore_rng_state(state, torch.device("cuda", 0))
    assert calls[-1] == ("set", "gen3", "cuda:0")
    assert torch.equal(torch.rand(3), expected)
    assert "cuda" not in capture_rng_state(torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# python -m torch.distributed.launch passes --local-rank


#: Every script that joins a process group (tests/test_distributed_teardown.py runs each of them).
DISTRIBUTED_SCRIPTS = ["chapters/ch04_deep_learning/multi_gpu_ddp.py", "labs/lab01_dp_vs_ddp/04_ddp_training.py",
                       "labs/lab03_precision_benchmark/benchmark_models.py",
                       "labs/lab04_sharded_training/01_memory_budget.py",
                       "labs/lab04_sharded_training/02_sharded_training.py",
                       "labs/lab04_sharded_training/03_largest_model.py", "labs/lab05_scaling/01_allreduce_bench.py",
                       "labs/lab05_scaling/03_overlap.py"]


@pytest.mark.parametrize("script", DISTRIBUTED_SCRIPTS)
def test_distributed_scripts_accept_the_old_launchers_local_rank(script, capsys):
    parser = load_script(script).build_parser()
    for flag in (["--local-rank=1"], ["--local_rank", "1"]):
        assert parser.parse_args(flag).launcher_local_rank == 1
    assert not hasattr(parser.parse_args([]), "launcher_local_rank")  # not in a record's config unless given
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "local" not in capsys.readouterr().out  # torchrun is the way: the old flag stays out of --help


# --------------------------------------------------------------------------------------------
# an old PyTorch is one line from every entry point

#: Modules PyTorch 1.6 did not have: the stand-in torch (helpers.fake_torch) refuses them, as the real 1.6 would.
NEWER_THAN_1_6 = ("torch.amp", "torch.profiler", "torch.utils.flop_counter", "torch.distributed.checkpoint",
                  "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo", "torch.func", "torch.export",
                  "torch.compiler")
def entry_points() -> list[str]:
    scripts = [*REPO.glob("chapters/*/*.py"), *REPO.glob("labs/*/*.py"), *REPO.glob("scripts/*.py"),
               *REPO.glob("bench/*.py")]
    return sorted(str(p.relative_to(REPO)) for p in scripts if 'if __name__ == "__main__"' in p.read_text())


def test_every_entry_point_names_an_old_torch_in_one_line(tmp_path):
    fake_torch(tmp_path, "1.6.0", missing=NEWER_THAN_1_6)
    env = script_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    from common import MINIMUM_VERSIONS

    floor = ".".join(map(str, MINIMUM_VERSIONS["torch"]))
    failures = []
    for script in entry_points():
        proc = subprocess.run([PYTHON, script, "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        err = proc.stderr.strip().splitlines()
        expected = f"error: torch 1.6.0 found, {floor} or newer"
        if proc.returncode != 2 or len(err) != 1 or not err[0].startswith(expected):
            failures.append(f"{script}: exit {proc.returncode}, stderr {proc.stderr.strip()[-300:]!r}")
    assert not failures, "\n".join(failures)


def test_minimum_versions_are_those_of_pyproject():
    from common import MINIMUM_VERSIONS, _release

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for package, minimum in MINIMUM_VERSIONS.items():
        (spec,) = [d for d in dependencies if re.match(rf"{package}\s*>=", d)]
        assert _release(spec.split(">=")[1]) == minimum
    assert _release("2.8.0a0+git3bcc") == (2, 8, 0) >= MINIMUM_VERSIONS["torch"]  # NGC containers' versions


# --------------------------------------------------------------------------------------------
# a run no longer than its warm-up says n/a


def test_a_run_shorter_than_its_warm_up_prints_na_not_zero_samples_per_s(tmp_path, capsys):
    import torch

    from common.measure.timing import StepTimer, format_rate, format_speedup

    timer = StepTimer(torch.device("cpu"), warmup_steps=2)
    for _ in range(2):
        with timer.step(samples=8):
            pass
    summary = timer.summary()
    assert summary["samples_per_s"] is None and "warm-up" in summary["not_timed"]
    assert (format_rate(summary["samples_per_s"]), format_speedup(None), format_rate(12.34)) == ("n/a", "n/a", "12.3")

    status = run_main("labs/lab01_dp_vs_ddp/02_baseline_single_gpu.py",
                      ["--device", "cpu", "--model", "plain_cnn", "--dataset", "synthetic", "--synthetic-size", "32",
                       "--batch-size", "16", "--epochs", "1", "--max-steps", "1", "--warmup-steps", "2",
                       "--num-workers", "0", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0 and "n/a samples/s" in out and " 0.0 samples/s" not in out
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["metrics"]["samples_per_s"] is None and record["metrics"]["step_time"]["steps_timed"] == 0


def test_report_shows_na_for_a_run_that_timed_nothing():
    from common.results import make_record
    from common.report.core import summary_section
    from common.report.runs import runs_frame

    records = [make_record(lab="lab01", script="x.py", method=method, config={"model": "m"},
                           metrics={"world_size": 1, "samples_per_s": rate, "step_time": {"steps_timed": timed}},
                           provenance={"hostname": "h", "device": {"type": "cpu", "name": "cpu"}})
               for method, rate, timed in (("baseline", 50.0, 4), ("dp", None, 0))]
    table = summary_section(runs_frame(records)).tables[0]
    rate, speedup = table.columns.index("samples/s"), table.columns.index("speed-up vs baseline")
    dp = next(row for row in table.rows if row[table.columns.index("method")].text == "dp")
    assert (dp[rate].text, dp[speedup].text) == ("n/a", "n/a") and "warm-up" in dp[rate].title


# --------------------------------------------------------------------------------------------
# On a real GPU


@pytest.mark.gpu
def test_gpu_nccl_group_is_bound_to_its_device_and_fp32_is_real(tmp_path):
    import torch
    import torch.distributed as dist

    from common.precision import fp32_math
    from common.runtime.distributed import init_distributed, teardown_distributed

    ctx = init_distributed("cuda", force_process_group=True)
    try:
        assert ctx.backend == "nccl" and dist.get_backend() == "nccl"
        tensor = torch.ones(4, device=ctx.device)
        dist.all_reduce(tensor)
        assert tensor.sum().item() == 4
        assert fp32_math() == {"matmul": "ieee", "cudnn_conv": "ieee"}
    finally:
        teardown_distributed(ctx)


def test_the_bandwidth_bench_on_task_3_of_srun_gpus_per_task_takes_its_own_gpu(fake_gpus, launch_env, monkeypatch,
                                                                               tmp_path):
    """Every task of ``srun --gpus-per-task=1`` sees one GPU, its own, as cuda:0: the bench must not take
    SLURM_LOCALID 3 for a fourth GPU on the node (it refused every task but the first)."""
    import torch
    import torch.distributed as dist

    from helpers import load_script

    bench = load_script("labs/lab05_scaling/01_allreduce_bench.py")
    fake_gpus(count=1)
    launch_env(SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_LOCALID="3", SLURM_NODEID="0",
               SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="4", SLURM_STEP_NODELIST="gpu01",
               SLURM_GPUS_PER_TASK="1")
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    asked = {}

    class Started(Exception):
        pass

    def init_process_group(*args, **kwargs):  # the group would wait for the other three tasks: stop here
        asked.update(kwargs, current=torch.cuda.current_device())
        raise Started

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Started):
        bench.main(["--device", "cuda", "--max-bytes", "4K", "--results-dir", str(tmp_path)])
    assert asked["backend"] == "nccl" and asked.get("device_id") in (None, torch.device("cuda", 0)), asked
