"""No thread of a process group is left when a distributed script ends.

A Gloo (or NCCL) process group runs threads of its own: Gloo's workers (``pt_gloo_runloop``), its
transport loop (``gloo_tcp_loop``), the rendezvous store's server on rank 0 (``pt_tcpstore*``), NCCL's
watchdog and heartbeat (``pt_nccl*``). If any of them is still alive when the interpreter shuts down,
a worker that releases a tensor takes the GIL from a finalising interpreter, and the process aborts
(``terminate called without an active exception``) *after* the script's main function returned:
the job fails under ``srun --kill-on-bad-exit`` although training succeeded. It happened to about
3 resumed DDP runs in 50 under Slurm. ``common.runtime.distributed`` makes sure that tearing the group down
really ends it; this test proves it for each distributed entry point.

Each entry point runs as a user runs it, in its own process on the CPU (Gloo), with the smallest
settings that still build a process group. ``tests/exit_threads/sitecustomize.py`` makes every
Python process of the run (the ranks a script spawns too) write down its threads at exit, after
main has returned; none may be a process group's.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import LAB03_DDP_ARGS, REPO, run_main, run_reporting_threads, run_script, script_env, torchrun

#: Thread names (``/proc/<pid>/task/<tid>/comm``, at most 15 characters) of a process group's threads.
GROUP_THREAD = re.compile(r"^(pt_gloo|gloo_tcp|pt_tcpstore|pt_nccl)")
TINY_TRAINING = ("--device", "cpu", "--dry-run", "--num-workers", "0")
TINY_TRANSFORMER = ("--layers", "4", "--width", "32", "--heads", "4", "--context", "32")


@dataclass(frozen=True)
class EntryPoint:
    """A distributed script, the arguments of a tiny run, and what proves that it built a group."""

    script: str
    args: tuple[str, ...]
    processes: int      # Python processes that run the script: itself, and the ranks it spawns
    proof: str          # printed only when the script trained under a process group
    ranks: int = 0      # started by torchrun with this many processes (a script that makes no group alone)


#: Every distributed entry point of the course. A new distributed script (one that makes a process group:
#: ``TrainingRun(..., distributed=True)``, ``open_process(..., distributed=True)``, ``init_distributed`` or
#: ``init_process_group``; test_every_script_that_makes_a_process_group_is_checked finds it) adds one line here:
#: its path, the smallest arguments that still create a process group on the CPU (a script that forces a group
#: even alone runs as one process; others need -g 2 or the like, or ``ranks`` to be started by torchrun), how
#: many Python processes run the script, and a line of its output that only a run under a process group prints.
#: ``{lab08_data}`` in the arguments is a tiny shard data set made once (Lab-08's 01_make_dataset.py).
ENTRY_POINTS = {
    # Its own one-process group, as a student's first check of an allocation does: torch's destroy_process_group.
    "lab01-01_environment_check": EntryPoint("labs/lab01_dp_vs_ddp/01_environment_check.py", ("--no-smoke-test",),
                                             1, "gloo: all-reduce on cpu: ok"),
    "ch04-multi_gpu_ddp": EntryPoint("chapters/ch04_deep_learning/multi_gpu_ddp.py",
                                     (*TINY_TRAINING, "--checkpoint", "ckpt.pt"), 1, "backend gloo"),
    "lab01-04_ddp_training": EntryPoint("labs/lab01_dp_vs_ddp/04_ddp_training.py",
                                        (*TINY_TRAINING, "--model", "plain_cnn", "--dataset", "synthetic",
                                         "--image-size", "16", "--synthetic-size", "32", "--batch-size", "8",
                                         "--checkpoint", "ckpt.pt"),
                                        1, "backend gloo"),
    # The run tests/test_lab03.py checks too (the session fixture lab03_ddp_run, tests/conftest.py).
    "lab03-benchmark_models-g2": EntryPoint("labs/lab03_precision_benchmark/benchmark_models.py", LAB03_DDP_ARGS,
                                            3, "2 process(es) with DDP"),
    "lab04-01_memory_budget": EntryPoint("labs/lab04_sharded_training/01_memory_budget.py",
                                         ("--device", "cpu", *TINY_TRANSFORMER, "--batch-size", "2"),
                                         1, "memory per rank: 1 rank(s)"),
    "lab04-02_sharded_training": EntryPoint("labs/lab04_sharded_training/02_sharded_training.py",
                                            (*TINY_TRAINING, *TINY_TRANSFORMER, "--global-batch-size", "16",
                                             "--batch-size", "4", "--eval-steps", "1", "--async-checkpoint"),
                                            1, "backend gloo"),
    "lab04-03_largest_model": EntryPoint("labs/lab04_sharded_training/03_largest_model.py",
                                         ("--device", "cpu", *TINY_TRANSFORMER, "--budget", "2MiB",
                                          "--max-doublings", "1", "--variants", "ddp", "fsdp"),
                                         1, "largest model: 1 rank(s)"),
    "lab05-01_allreduce_bench": EntryPoint("labs/lab05_scaling/01_allreduce_bench.py",
                                           ("--device", "cpu", "--min-bytes", "1K", "--max-bytes", "4K",
                                            "--repeats", "2", "--warmup", "1", "--memcpy-repeats", "1"),
                                           1, "backend gloo"),
    "lab06-01_inject": EntryPoint("labs/lab06_failures/01_inject.py",
                                  ("--device", "cpu", "--steps", "2", "--checkpoint-every", "1", "--run-dir", "run"),
                                  1, "backend gloo"),
    "lab05-03_overlap": EntryPoint("labs/lab05_scaling/03_overlap.py",
                                   ("--device", "cpu", "--model", "resnet18", "--image-size", "16", "--batch-size",
                                    "2", "--bucket-cap-mb", "1", "--repeats", "2", "--warmup-steps", "1"),
                                   1, "backend gloo"),
    # Tensor parallel, FSDP2 and a DCP save on a 1 x 2 mesh: DTensor's caches hold meshes, meshes hold groups.
    "lab07-03_2d_parallel": EntryPoint("labs/lab07_model_parallel/03_2d_parallel.py",
                                       ("--device", "cpu", "--dry-run", "--layers", "2", "--width", "32", "--heads",
                                        "4", "--context", "16", "--batch-size", "4", "--mesh", "1x2"),
                                       2, "= 2 process(es)", ranks=2),
    # Shards read exactly once under a group: StatefulDataLoader workers beside the group's threads.
    "lab08-03_shards_exactly_once": EntryPoint("labs/lab08_data_at_scale/03_shards_exactly_once.py",
                                               ("--data-dir", "{lab08_data}", "--device", "cpu", "--num-workers", "1",
                                                "--batch-size", "8", "--epochs", "1", "--checkpoint", "ckpt.pt"),
                                               1, "placement: cores"),
}
#: Scripts that make a process group but are not in ENTRY_POINTS, and why.
#: Lab-07's 01 and 02 make a group only at two ranks or more (``init_distributed`` without ``force_process_group``:
#: alone, they run with no group and would prove nothing here), so each check is a torchrun launch of 2 ranks of
#: its own: three Python processes importing torch (torchrun's agent and the two ranks). Their tiniest run
#: (``--device cpu --dry-run --layers 2 --width 32 --heads 4 --context 16 --batch-size 4``) took 23 s wall and
#: 24 s of CPU each on the course's 2-core VM (at 89bea98), the cost of lab07-03_2d_parallel's entry again, for a
#: teardown path (``teardown_distributed``) that entry already checks with a DeviceMesh and DTensor's caches: over
#: the budget of a few seconds of CPU per added check. Run by hand at 89bea98 with ``tests/exit_threads`` on
#: ``PYTHONPATH`` and ``HPC_DL_LABS_THREAD_REPORT`` set, both left no process group thread in any of the three
#: processes. To check them anyway, add each as ``EntryPoint(script, (that run), 2, "record:", ranks=2)``.
_TWO_RANK_LAUNCH = "makes its group only at 2 ranks or more: a torchrun launch of its own, 24 s of CPU (see above)"
NOT_CHECKED = {
    "labs/lab07_model_parallel/01_tensor_parallel.py": _TWO_RANK_LAUNCH,
    "labs/lab07_model_parallel/02_pipeline_parallel.py": _TWO_RANK_LAUNCH,
}


@pytest.fixture(scope="module")
def entry_runs(request, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every entry point's run, {name: (finished process, its folder)}. Two run at a time beside
    Lab-03's (most of each is one process importing torch: one core of the two); the runs share
    nothing but the machine, and each finds its own free port."""
    # The folders first, in this thread: tmp_path_factory is not thread-safe (two threads that make the
    # session's first temporary folder at once each make a base folder of their own).
    # Only the entry points of the tests this session runs (``-k lab08`` runs one script, not all of them).
    wanted = {item.callspec.params["name"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_no_process_group_thread_is_left_at_exit"}
    folders = {name: tmp_path_factory.mktemp(name) for name, entry in ENTRY_POINTS.items()
               if entry.args != LAB03_DDP_ARGS and name in wanted}

    lab08_data = tmp_path_factory.mktemp("lab08") / "data"
    if any("{lab08_data}" in ENTRY_POINTS[name].args for name in folders):
        # torchvision 0.29's JPEG encoder warns that TorchCodec replaces it (Lab-08's README): not this file's subject.
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert run_main("labs/lab08_data_at_scale/01_make_dataset.py", [
                "--samples", "48", "--shard-size", "16", "--data-dir", str(lab08_data),
                "--results-dir", str(lab08_data.parent / "made")]) == 0

    def run(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        entry, folder = ENTRY_POINTS[name], folders[name]
        args = [str(lab08_data) if arg == "{lab08_data}" else arg for arg in entry.args]
        return run_reporting_threads(entry.script, *args, "--results-dir", str(folder / "results"),
                                     folder=folder, launcher=torchrun(entry.ranks) if entry.ranks else None), folder

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, name) for name in folders}
        runs = {name: request.getfixturevalue("lab03_ddp_run")
                for name, entry in ENTRY_POINTS.items() if entry.args == LAB03_DDP_ARGS and name in wanted}
        runs.update({name: future.result() for name, future in futures.items()})
    return runs


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_no_process_group_thread_is_left_at_exit(name, entry_runs):
    entry = ENTRY_POINTS[name]
    result, folder = entry_runs[name]
    reports = folder / "threads"
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert entry.proof in output, output[-3000:]  # it really ran under a process group

    found = [json.loads(path.read_text()) for path in sorted(reports.glob("*.json"))]
    ran_script = [report for report in found if report["argv"][0].endswith(entry.script)]  # not helpers
    assert len(ran_script) == entry.processes, f"{len(ran_script)} of {entry.processes} processes reported: {found}"
    left = {report["pid"]: [t for t in report["threads"] if GROUP_THREAD.match(t)] for report in found}
    assert not any(left.values()), f"{name}: process group threads alive at exit, by process: {left}"


def makes_a_process_group(script: Path) -> bool:
    """Whether a script calls what makes a process group: init_distributed, init_process_group, or TrainingRun or
    open_process with ``distributed=True``."""
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            forced = any(k.arg == "distributed" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in node.keywords)
            if name in ("init_distributed", "init_process_group") or (
                    name in ("TrainingRun", "open_process") and forced):
                return True
    return False


def test_every_script_that_makes_a_process_group_is_checked():
    """A new distributed lesson is in ENTRY_POINTS (or NOT_CHECKED, with the reason), not silently outside the check."""
    lessons = [p for p in [*REPO.glob("chapters/*/*.py"), *REPO.glob("labs/*/*.py")]
               if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8")]
    making = {str(p.relative_to(REPO)) for p in lessons if makes_a_process_group(p)}
    assert {"labs/lab01_dp_vs_ddp/04_ddp_training.py", "labs/lab04_sharded_training/01_memory_budget.py",
            "labs/lab06_failures/01_inject.py"} <= making  # the three ways in are found
    checked = {entry.script for entry in ENTRY_POINTS.values()} | set(NOT_CHECKED)
    assert not making - checked, (f"scripts that make a process group but are not in ENTRY_POINTS of "
                                  f"tests/test_distributed_teardown.py: {sorted(making - checked)}")
    assert not checked - making, f"listed but they make no process group: {sorted(checked - making)}"


def test_the_report_hook_sees_a_group_thread_that_outlives_main(tmp_path):
    """The negative control: a process that keeps its group to the end is caught."""
    reports = tmp_path / "threads"
    reports.mkdir()
    keep_group = tmp_path / "keep_group.py"
    keep_group.write_text("from common.runtime.distributed import init_distributed\n"
                          "kept = init_distributed('cpu', force_process_group=True)  # never torn down\n")
    env = script_env(HPC_DL_LABS_THREAD_REPORT=str(reports))
    env["PYTHONPATH"] = f"{REPO / 'tests' / 'exit_threads'}:{env['PYTHONPATH']}"
    result = run_script(str(keep_group), env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (report,) = [json.loads(path.read_text()) for path in reports.glob("*.json")]
    assert any(GROUP_THREAD.match(t) for t in report["threads"]), report


def test_a_device_mesh_that_outlives_the_teardown_does_not_keep_its_group_s_threads(tmp_path):
    """On torch 2.11 DTensor's sharding objects keep a device mesh past the teardown where no cache clear reaches
    them (Lab-04's three scripts and Lab-07's 2-D mesh left Gloo's threads at exit there); a mesh holds its groups.
    Here the script itself keeps one, on any release: the teardown must still end the group's threads."""
    (tmp_path / "keep_mesh.py").write_text(
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from common.runtime.distributed import open_process, teardown_distributed\n"
        "ctx = open_process('cpu', distributed=True)\n"
        "mesh = init_device_mesh('cpu', (1,))  # still referenced at exit\n"
        "teardown_distributed(ctx)\n"
        "print('mesh over', mesh.size(), 'rank(s)')\n")
    result = run_reporting_threads(str(tmp_path / "keep_mesh.py"), folder=tmp_path, timeout=120)
    assert result.returncode == 0 and "mesh over 1 rank(s)" in result.stdout, result.stderr[-3000:]
    (report,) = [json.loads(path.read_text()) for path in (tmp_path / "threads").glob("*.json")]
    assert not [t for t in report["threads"] if GROUP_THREAD.match(t)], report


def test_every_torch_module_that_binds_the_world_group_is_imported_before_the_group():
    """Scan torch.distributed's sources for ``def f(..., group=group.WORLD)``: a torch upgrade that adds
    one must add its module to common.runtime.distributed.MODULES_BINDING_THE_WORLD_GROUP, or its import after
    init would hold the group (and its threads) to the end of the process."""
    import torch.distributed

    from common.runtime.distributed import MODULES_BINDING_THE_WORLD_GROUP

    root = Path(torch.distributed.__file__).parent
    binding = set()
    for path in root.rglob("*.py"):
        source = path.read_text(encoding="utf-8", errors="replace")
        if "WORLD" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                defaults = [*node.args.defaults, *filter(None, node.args.kw_defaults)]
                if any(ast.unparse(default).endswith("group.WORLD") for default in defaults):
                    binding.add(".".join(path.relative_to(root.parent.parent).with_suffix("").parts))
    # distributed_c10d is imported with torch.distributed itself, long before any group exists.
    binding.discard("torch.distributed.distributed_c10d")
    assert binding, "the scan found nothing: torch.distributed.nn.functional has such defaults"
    assert binding <= set(MODULES_BINDING_THE_WORLD_GROUP), binding - set(MODULES_BINDING_THE_WORLD_GROUP)


def test_teardown_leaves_the_environment_as_it_found_it(tmp_path):
    """init_distributed maps a launch onto torchrun's variables (RANK, MASTER_PORT, ...); the ones it
    added go again at teardown, so a second run in the same process (a notebook, a test) does not
    inherit the first one's rendezvous port. Variables the launcher set are left alone."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "from common.runtime.distributed import init_distributed, teardown_distributed\n"
        "names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')\n"
        "os.environ['MASTER_ADDR'] = '127.0.0.1'  # as a launcher would have set it\n"
        "before = {k: os.environ.get(k) for k in names}\n"
        "ctx = init_distributed('cpu', force_process_group=True)\n"
        "during = {k: os.environ.get(k) for k in names}\n"
        "teardown_distributed(ctx)\n"
        "after = {k: os.environ.get(k) for k in names}\n"
        "print('during', sorted(k for k, v in during.items() if v is not None))\n"
        "print('same', after == before)\n")
    env = script_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = run_script(str(probe), env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "during ['LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE']" in result.stdout
    assert "same True" in result.stdout, result.stdout
