"""The course's PyTorch floor and ``common.runtime.compat``, the one module that knows what differs between releases.

These tests run twice in CI: with the locked (newest) PyTorch in the suite, and with the floor's in
``.venv-floor/`` (``scripts/torch_floor.sh``), so each difference is exercised on both sides of it.
They ask the real PyTorch of the environment; none may depend on which release that is.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
import tomllib
import warnings

import pytest

import common
from helpers import REPO, fake_torch, script_env

FLOOR = common.MINIMUM_VERSIONS["torch"]
FLOOR_TEXT = ".".join(map(str, FLOOR))


def load(relpath: str):
    spec = importlib.util.spec_from_file_location(f"compat_test_{relpath.replace('/', '_')[:-3]}", REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def release() -> tuple[int, ...]:
    """This PyTorch's (major, minor), as compat reads it."""
    from common.runtime.compat import _torch_release

    return _torch_release()


# --------------------------------------------------------------------------------------------
# The floor: one line below it, vendor builds read as their release, stated everywhere


def test_below_the_floor_is_one_line_and_a_vendor_build_reads_as_its_release(monkeypatch):
    below = f"{FLOOR[0]}.{FLOOR[1] - 1}.1+cu126"
    versions = {"torch": f"{FLOOR_TEXT}.0a0+5228986c39", "torchvision": "0.23.0a0+428a54c"}  # as NGC names them
    monkeypatch.setattr(common, "installed_version", versions.get)
    assert common.version_problem() is None
    versions["torch"] = below
    assert common.version_problem() == f"torch {below} found, {FLOOR_TEXT} or newer needed"
    versions["torch"] = "2.15.0"  # no upper cap: a newer module is never refused
    assert common.version_problem() is None


def test_a_lesson_below_the_floor_stops_at_start_in_one_line(tmp_path):
    """A real script, with a torch that reports the release before the floor: one line, exit 2, nothing run."""
    below = f"{FLOOR[0]}.{FLOOR[1] - 1}.1"
    fake_torch(tmp_path, below)  # imports of torch before common's check succeed, as with a real one
    env = script_env(PYTHONPATH=f"{tmp_path}:{REPO}")
    done = subprocess.run([sys.executable, "labs/lab07_model_parallel/02_pipeline_parallel.py", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: torch {below} found, {FLOOR_TEXT} or newer needed"), line


def test_the_floor_is_the_release_ci_runs_and_every_install_file_states_it():
    floor_script = (REPO / "scripts" / "torch_floor.sh").read_text()
    torch_pin = re.search(r"^TORCH=(\S+)$", floor_script, re.M).group(1)
    assert common._release(torch_pin)[:2] == FLOOR
    vision_pin = re.search(r"^TORCHVISION=(\S+)$", floor_script, re.M).group(1)
    assert common._release(vision_pin)[:2] == common.MINIMUM_VERSIONS["torchvision"]
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={FLOOR_TEXT}" in dependencies and not any("torch<" in d for d in dependencies)  # no cap
    # The newest release tested is the lock's torch (the suite's environment).
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    newest = max((p["version"] for p in lock["package"] if p["name"] == "torch"), key=common._release)
    stated = {path: (REPO / path).read_text() for path in
              ("README.md", "pyproject.toml", "environments/ml-gpu.yaml", "environments/ml-cpu.yaml",
               "slurm/module-loads/pytorch.sh")}
    for path, text in stated.items():
        assert f"PyTorch {FLOOR_TEXT}" in text and newest in text, \
            f"{path} does not state the floor (PyTorch {FLOOR_TEXT}) and the newest release tested ({newest})"


def test_every_lesson_script_has_a_shortest_run_at_the_floor():
    runs = load("scripts/torch_floor.py").RUNS
    lessons = sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("chapters/*/*.py"), *REPO.glob("labs/*/*.py")]
                     if 'if __name__ == "__main__"' in p.read_text())
    listed = {run.script for run in runs.values()}
    assert not set(lessons) - listed, ("lesson scripts with no shortest run at the floor: "
                                       f"{sorted(set(lessons) - listed)}; "
                                       "add a LessonRun for each to RUNS in scripts/torch_floor.py")
    assert not listed - set(lessons), ("RUNS in scripts/torch_floor.py names scripts that are not lessons: "
                                       f"{listed - set(lessons)}")
    stated = re.search(r"(\d+) of \1 lesson runs ok", (REPO / "README.md").read_text())  # the line the floor ends with
    assert stated and int(stated[1]) == len(runs), f"README.md should quote '{len(runs)} of {len(runs)} lesson runs ok'"
    assert all(not run.folder or list(runs).index(run.folder) < list(runs).index(name) for name, run in runs.items())


# --------------------------------------------------------------------------------------------
# The differences, each asked of this PyTorch


@pytest.fixture
def one_rank_group():
    from common.runtime.distributed import init_distributed, teardown_distributed

    ctx = init_distributed("cpu", force_process_group=True)
    try:
        yield ctx
    finally:
        teardown_distributed(ctx)


def test_ddp_gets_the_buffer_option_under_the_name_this_release_takes(one_rank_group):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from common.runtime.compat import ddp_buffer_sync

    option = ddp_buffer_sync(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old name warns where the new one exists
        model = DistributedDataParallel(torch.nn.Linear(2, 2), **option)
    assert (model.broadcast_buffers if hasattr(model, "broadcast_buffers") else
            model.forward_sync_buffers) is False
    other = {"broadcast_buffers": False} if "forward_sync_buffers" in option else {"forward_sync_buffers": False}
    with pytest.raises((TypeError, Warning)), warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedDataParallel(torch.nn.Linear(2, 2), **other)


def test_dtensor_caches_are_emptied_wherever_this_release_keeps_them(one_rank_group):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from common.runtime.compat import clear_dtensor_caches

    propagate = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    fast_path_stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", lambda: (0, 0))

    def cached() -> int:  # Python's entries, plus the C++ fast path's lookups (2.15 answers from it alone)
        return propagate.cache_info().currsize + sum(fast_path_stats())

    mesh = init_device_mesh("cpu", (1,))
    (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2).sum()
    assert cached() > 0
    cleared = clear_dtensor_caches()
    assert "sharding propagation" in cleared and cached() == 0, cleared


#: Two Gloo ranks: both join, then rank 0 calls an all-reduce that rank 1 never joins. With the
#: group's start-up timeout (60 s) it would wait a minute; set_collective_timeout makes it 2 s.
STALLED = textwrap.dedent("""
    import datetime, sys, time
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d
    from common.runtime.compat import set_collective_timeout
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    call = set_collective_timeout(2.0)
    if call is None:  # an older release: its private call, tried here, and rank 1 comes 6 s late
        distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2.0))
        if rank == 1:
            time.sleep(6)
        began = time.perf_counter()
        dist.all_reduce(torch.ones(1))
        print("CALL", call, "PRIVATE CALL WAITED", round(time.perf_counter() - began, 1), flush=True)
    elif rank == 1:  # stays out of the all-reduce until rank 0 has its answer (or 30 s)
        store.wait(["answered"], datetime.timedelta(seconds=30))
        store.set("bye", "1")
    else:
        began = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1))
            print("CALL", call, "FINISHED")
        except RuntimeError:
            print("CALL", call, "FAILED AFTER", round(time.perf_counter() - began, 1), flush=True)
        store.set("answered", "1")
        store.wait(["bye"], datetime.timedelta(seconds=30))  # the store lives in this process: rank 1 reads first
    """)


def test_a_short_collective_timeout_fails_a_stalled_collective_in_seconds():
    """A Gloo collective that a rank stays out of fails after the short timeout: through
    ``torch.distributed.set_timeout`` where it exists (2.14 on), else through the private ``_set_pg_timeout``
    (2.9 to 2.13). On 2.8 (the floor) the private call leaves a Gloo group's collectives on the start-up
    timeout: the compatibility module says so (None), and the private call, tried anyway, lets rank 0's
    collective wait for rank 1's 6 s."""
    from common.runtime.compat import GLOO_READS_PRIVATE_TIMEOUT
    from common.runtime.launch import free_port

    port, env = str(free_port()), script_env(OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, "-c", STALLED, str(rank), port], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    out = [rank.communicate(timeout=180)[0] for rank in ranks][0]
    if release() < GLOO_READS_PRIVATE_TIMEOUT:
        waited = re.search(r"CALL None PRIVATE CALL WAITED ([\d.]+)", out)
        assert waited and float(waited.group(1)) >= 4.0, out[-2000:]  # past the 2 s it was given
        return
    found = re.search(r"CALL (\S+) FAILED AFTER ([\d.]+)", out)
    distributed = __import__("torch.distributed").distributed
    expected = "set_timeout" if hasattr(distributed, "set_timeout") else "_set_pg_timeout"
    assert found and found.group(1) == expected, out[-2000:]
    assert 1.5 <= float(found.group(2)) < 30, out  # the short timeout, not rank 1's 30 s or the group's minute


def test_the_private_timeout_call_is_used_only_where_it_reaches_the_group(monkeypatch):
    """A release without ``torch.distributed.set_timeout``: the private call for an NCCL group (its watchdog
    reads it), and for a Gloo group from 2.9 on; nothing for 2.8's Gloo group (the test above: its collectives
    do not read it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from common.runtime import compat

    calls = []
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    monkeypatch.setattr(distributed_c10d, "_set_pg_timeout", lambda timeout, group: calls.append(timeout),
                        raising=False)
    for version, backend, expected in (("2.8.0", "nccl", "_set_pg_timeout"), ("2.8.0", "gloo", None),
                                       ("2.11.0+cu130", "gloo", "_set_pg_timeout")):
        monkeypatch.setattr(compat.torch, "__version__", version)
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        assert compat.set_collective_timeout(3.0) == expected, (version, backend)
    assert [timeout.total_seconds() for timeout in calls] == [3.0, 3.0]


def test_what_the_gpu_must_prove_is_listed_with_a_release_this_one_agrees_with():
    import torch
    import torch.distributed as dist

    from common.runtime.compat import GPU_ONLY, new_tf32_api, paths

    checks = {check.name for check in load("scripts/gpu_proof_checks.py").CHECKS}
    assert {difference.check for difference in GPU_ONLY} <= checks
    needs = {difference.name.split(":")[0]: difference.needs for difference in GPU_ONLY}
    # What a CPU can see of each: the call or attribute exists from the release the list names.
    assert new_tf32_api() == (release() >= needs["TF32 per back end"])
    assert hasattr(dist, "set_timeout") == (release() >= needs["a short timeout on an NCCL group that exists"])
    if dist.is_nccl_available():  # a CUDA build (PyPI's Linux wheels are)
        from torch._C import _distributed_c10d

        assert hasattr(_distributed_c10d, "_dump_nccl_trace_json") == (release() >= needs["NCCL flight recorder"])
    found = paths()
    assert found["torch"] == torch.__version__
    assert found["tf32_api"] == ("fp32_precision" if new_tf32_api() else "allow_tf32")


#: torch names the course reaches only after asking this release whether it has them (common.runtime.compat's
#: ``new_tf32_api()``, ``hasattr(dist, "set_timeout")``): newer than the floor. Every other name must be in each
#: release.
NEWER_THAN_THE_FLOOR = {"torch.backends.fp32_precision", "torch.backends.cudnn.fp32_precision",
                        "torch.backends.cudnn.conv", "torch.backends.cudnn.rnn.fp32_precision",
                        "torch.distributed.set_timeout"}
SET_ONCE_A_GROUP_EXISTS = {"torch.distributed.group.WORLD"}
PACKAGES = ("torch", "torchvision", "torchdata", "webdataset")
#: What missing_names finds where a name's module needs a package this environment lacks: it cannot say.
UNCHECKED = object()


def missing_names(source: str) -> dict[str, int]:
    """Every dotted name of PACKAGES that ``source`` uses (``import``/``from`` anywhere, attribute chains on
    their names) and this environment lacks: {the name as resolved: the line}. A chain is followed while it
    stays on modules and classes; what a call returns is not looked into."""
    import ast
    import importlib
    import inspect

    def module(name: str):
        """The module, ``None`` where this release lacks it, or UNCHECKED where it imports a package this environment
        does not have (``torch.utils.tensorboard`` without tensorboard, webdataset on a GPU image): nothing to ask."""
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            lacks_it = err.name is not None and (name == err.name or name.startswith(f"{err.name}."))
            installed = importlib.util.find_spec(name.split(".")[0]) is not None
            return None if lacks_it and installed else UNCHECKED
        except ImportError:
            return None

    tree, names, missing = ast.parse(source), {}, {}
    for node in ast.walk(tree):  # the names imports bind, in any scope
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in PACKAGES:
                    names[alias.asname or top] = alias.name if alias.asname else top
                    if module(alias.name) is None:
                        missing[alias.name] = node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in names):
            continue
        parts = names[node.id].split(".") + chain
        found = module(parts[0])
        if found is UNCHECKED:
            continue
        for depth, part in enumerate(parts[1:], 2):
            inner = getattr(found, part, None)
            if inner is None and inspect.ismodule(found):
                inner = module(f"{found.__name__}.{part}")
            if inner is UNCHECKED:
                break
            if inner is None:
                missing[".".join(parts[:depth])] = node.lineno
                break
            if not (inspect.ismodule(inner) or inspect.isclass(inner)):
                break
            found = inner
    return missing


def test_a_name_whose_module_needs_a_package_this_environment_lacks_is_not_called_missing(monkeypatch):
    """The GPU image has torch but not tensorboard, torchdata or webdataset: the lookup cannot say there, and a
    misspelt torch name next to them is still found."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails, as where it is not installed
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setitem(sys.modules, "webdataset", None)
    assert missing_names("from torch.utils.tensorboard import SummaryWriter\nimport torch.utils.tensorboard\n"
                         "import webdataset as wds\nwds.WebDataset\nimport torch.utils.no_such_module\n") == {
        "torch.utils.no_such_module": 5}


def test_every_torch_name_the_code_uses_is_in_this_release():
    """The CUDA-only branches never run on a CPU, so a torch name there that this release lacks (misspelt, removed,
    or newer than the floor) would first fail on a GPU. Each one the code names is looked up here instead."""
    assert missing_names("import torch\nfrom torch import cuda\ntorch.cuda.max_memory_allocated()\n"
                         "cuda.no_such_call()\nimport torch.nn as nn\nnn.Linear.no_such_method\n") == {
        "torch.cuda.no_such_call": 4, "torch.nn.Linear.no_such_method": 6}
    found = {}
    for folder in ("common", "labs", "chapters", "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for name, line in missing_names(path.read_text(encoding="utf-8")).items():
                found.setdefault(name, f"{path.relative_to(REPO)}:{line}")
    unexpected = {name: where for name, where in found.items()
                  if name not in NEWER_THAN_THE_FLOOR | SET_ONCE_A_GROUP_EXISTS}
    assert not unexpected, f"torch {release()} lacks: {unexpected}"
