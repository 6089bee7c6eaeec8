"""Helpers shared by the test files: run a script in-process (cheap) or as a real process.

``import torch`` costs seconds, so most tests call a script's ``main(argv)`` inside the pytest
process (torch is imported once). Tests that are about a launcher, an exit status or a traceback
run the script as a subprocess with :func:`run_script`.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
_loaded: dict[Path, ModuleType] = {}


def load_script(relpath: str) -> ModuleType:
    """Import a script (e.g. ``chapters/ch04_deep_learning/mnist_training.py``) as a module, once."""
    path = (REPO / relpath).resolve()
    if path not in _loaded:
        name = "script_" + "_".join(path.relative_to(REPO).with_suffix("").parts).replace("-", "_")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader, f"cannot import {path}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _loaded[path] = module
    return _loaded[path]


def run_main(relpath: str, argv: list[str]) -> int:
    """Run ``main(argv)`` of a script the way its ``__main__`` does; return the exit status."""
    from common.errors import run_main as _run_main

    module = load_script(relpath)
    try:
        _run_main(module.main, argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def code_diff(path_a: str, path_b: str) -> list[str]:
    """The code lines that differ between two scripts (``-`` only in ``a``, ``+`` only in ``b``).

    Module docstrings and blank lines are left out: what remains is what a student sees when they
    diff a lesson script against the next one, and that should be the lesson and little else.
    """
    import ast
    import difflib

    def code(relpath: str) -> list[str]:
        source = (REPO / relpath).read_text()
        docstring_end = ast.parse(source).body[0].end_lineno
        return [line for line in source.splitlines()[docstring_end:] if line.strip()]

    return [line for line in difflib.unified_diff(code(path_a), code(path_b), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def wait_for(condition, timeout: float, what: str, poll: float = 0.1):
    """Poll ``condition()`` until it returns something true (returned); fail after ``timeout`` s."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def signalling_timer(timer_class: type, during_step: int, signum: int | None = None) -> type:
    """``timer_class`` (a script's real ``StepTimer``) that raises ``signum`` (default SIGUSR1, what
    ``#SBATCH --signal=B:USR1@120`` sends) while step ``during_step`` (0-based, counted over the
    whole run) is under way: a pre-emption arriving mid-epoch, at a step the test chooses."""
    import signal

    class SignallingTimer(timer_class):  # type: ignore[misc, valid-type]
        def step(self, samples, **how):
            if self.seen == during_step:
                signal.raise_signal(signal.SIGUSR1 if signum is None else signum)
            return super().step(samples, **how)

    return SignallingTimer


def preempt_and_resume(script: str, argv: list[str], folder: Path, monkeypatch, capsys, *, during_step: int,
                       stopped_at: str):
    """The pre-emption round trip of a training script, each run in-process under ``folder``:
    ``whole`` (never stopped), ``cut`` (a real SIGUSR1 while step ``during_step`` runs, see
    :func:`signalling_timer`), then ``cut`` again with ``--resume``. Asserts that the stop saved the
    checkpoint ``at {stopped_at}`` (e.g. ``"epoch 2 step 3"``) and wrote no record, that the signal
    handler is gone again, and that the resumed run ends with the whole run's weights.

    Returns ``run(name, *extra)`` (one more run with ``argv``, ``--results-dir folder/name`` and
    ``--checkpoint folder/name.pt``) and the whole run's checkpoint. Undoes ``monkeypatch``.
    """
    import signal

    import torch

    import common.train.meter

    def run(name: str, *extra: str) -> int:
        return run_main(script, [*argv, "--results-dir", str(folder / name), "--checkpoint", str(folder / f"{name}.pt"),
                                 *extra])

    assert run("whole") == 0
    timer = signalling_timer(common.train.meter.StepTimer, during_step=during_step)
    monkeypatch.setattr(common.train.meter, "StepTimer", timer)
    assert run("cut") == 0
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert "received SIGUSR1: saved" in out and f"at {stopped_at}" in out, out
    assert not (folder / "cut").exists()  # stopped before the end: no record
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is gone again
    assert run("cut", "--resume") == 0
    assert "resumed from" in capsys.readouterr().out
    whole, resumed = (torch.load(folder / f"{name}.pt", weights_only=False) for name in ("whole", "cut"))
    assert all(torch.equal(whole["model"][key], resumed["model"][key]) for key in whole["model"])
    return run, whole


def render_two_tasks(template: Path, script: Path) -> Path:
    """``template`` rendered for the generic site with 2 GPUs: 2 tasks on one node, one core each, into ``script``.

    One core each, because the Slurm test cluster does not confine tasks: two tasks of 2 threads would
    share this machine's 2 cores and spin against each other in every all-reduce (~50x slower).
    """
    render_sbatch = load_script("scripts/render_sbatch.py")
    text, job = render_sbatch.render(render_sbatch.read_template(template), render_sbatch.find_site("generic"),
                                     {"gpus_per_node": 2, "cpus_per_task": 1})
    assert job["ntasks"] == 2
    script.write_text(text)
    return script


_FAKE_TORCH = """
import importlib.abc, importlib.machinery, sys
__version__ = __VERSION__
MISSING = __MISSING__

class Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    \"\"\"Any torch.* module but MISSING, as an empty stand-in whose attributes are dummy classes.\"\"\"
    def find_spec(self, name, path, target=None):
        if name.startswith("torch.") and not name.startswith(MISSING):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        module.__getattr__ = lambda attr: type(attr, (), {})

sys.meta_path.insert(0, Stubs())

def __getattr__(attr):
    return type(attr, (), {})
"""


def fake_torch(root: Path, version: str, missing: tuple[str, ...] = ()) -> Path:
    """A stand-in ``torch`` package in ``root`` (with its dist-info, which importlib.metadata reads) that says it is
    ``version``: imports of torch and of its modules but ``missing`` succeed, and what they hold is empty, as far as
    a script gets before common's version check stops it. Put ``root`` first on PYTHONPATH; returns ``root``."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(
        _FAKE_TORCH.replace("__VERSION__", repr(version)).replace("__MISSING__", repr(tuple(missing))))
    (root / f"torch-{version}.dist-info").mkdir()
    (root / f"torch-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return root


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a script subprocess: this interpreter's, the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                    "MASTER_ADDR", "MASTER_PORT"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def run_script(relpath: str, *args: str, cwd: Path | None = None, timeout: float = 300,
               env: dict[str, str] | None = None, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run a script as a real process (``launcher`` e.g. torchrun's argv prefix); capture output."""
    command = [*(launcher or [PYTHON]), str(REPO / relpath), *args]
    return subprocess.run(command, cwd=cwd or REPO, env=env or script_env(), capture_output=True, text=True,
                          timeout=timeout)


def terminate_when(command: list[str], when: str, marker: str, env: dict[str, str],
                   while_running: Callable[[], object] = lambda: None) -> tuple[int, str, list[str], object]:
    """Start ``command``, a script that runs other processes, in a session of its own; at the first line of its output
    (stdout and stderr together) that holds ``when``, call ``while_running``, send SIGTERM to the script alone (as
    ``kill PID`` does) and wait for it. Its exit status, its whole output, the processes still running whose command
    line holds ``marker`` (a folder of the test's: none may outlive the script) and what ``while_running`` returned.
    Whatever is left is killed at the end, the script's session and any process with ``marker`` (torchrun gives its
    ranks sessions of their own)."""
    import contextlib
    import signal

    def running() -> list[str]:
        return [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _command_line(pid)]

    script = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True)
    seen, during = [], None
    try:
        for line in script.stdout:
            seen.append(line)
            if when in line:
                during = while_running()
                script.send_signal(signal.SIGTERM)
                break
        output = "".join(seen) + script.communicate(timeout=120)[0]
        left = running()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
        for pid in running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    return script.returncode, output, left, during


def _command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # it ended meanwhile
        return ""


def run_fresh(relpath: str, argv: list[str], timeout: float = 300) -> str:
    """Run a script in a fresh process, as a user does; assert it succeeded; return its output.

    GPU tests use this rather than :func:`run_main`: in the test process an earlier test may have
    started CUDA already, which hides every bug of a script that uses CUDA before starting it.
    """
    done = run_script(relpath, *argv, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def torchrun(nproc: int) -> list[str]:
    """argv prefix for ``torchrun --standalone --nproc_per_node=N`` with this interpreter."""
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def write_tiny_mnist(root: Path, train: int = 12, test: int = 5) -> None:
    """MNIST/raw/ in the IDX format torchvision reads (magic 2051 images, 2049 labels, big-endian)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", train), ("t10k", test)):
        pixels = bytes((i * 7) % 256 for i in range(count * 28 * 28))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, count, 28, 28) + pixels)
        labels = bytes(i % 10 for i in range(count))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels)


def fake_cpuinfo(model: str, flags: str, cpus: int = 2, threads_per_core: int = 1) -> str:
    """``/proc/cpuinfo`` of an x86 machine with ``cpus`` logical CPUs (``threads_per_core`` per core),
    for tests that describe another machine than the one they run on."""
    return "\n\n".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\nmodel name\t: {model}\nphysical id\t: 0\n"
                       f"core id\t\t: {i // threads_per_core}\nflags\t\t: fpu sse2 {flags}"
                       for i in range(cpus)) + "\n"


def run_reporting_threads(relpath: str, *args: str, folder: Path, timeout: float = 240,
                          launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """:func:`run_script` in ``folder`` with every Python process of the run writing down its threads at
    exit into ``folder/threads`` (``tests/exit_threads/sitecustomize.py``; tests/test_distributed_teardown.py)."""
    (folder / "threads").mkdir(parents=True)
    env = script_env(HPC_DL_LABS_THREAD_REPORT=str(folder / "threads"))
    env["PYTHONPATH"] = f"{Path(__file__).resolve().parent / 'exit_threads'}{os.pathsep}{env['PYTHONPATH']}"
    return run_script(relpath, *args, cwd=folder, env=env, timeout=timeout, launcher=launcher)


def launch_plan(processes: int, plan: list[dict], root: Path, name: str) -> dict[str, int]:
    """Run ``plan`` in one job of ``processes`` ranks of ``tests/lab04_worker.py``; return each run's
    exit status, by name (tests/test_lab04.py, tests/test_lab07.py).

    The ranks are started as torchrun starts them (its variables, one thread each), without
    torchrun's agent: one process fewer importing torch. They read the bytecode the set-up compiled
    into the environment (``compile-bytecode`` in pyproject.toml): a ``PYTHONPYCACHEPREFIX`` would
    hide it, and every rank of the first launch would compile torch's sources again (7 s of CPU each).
    """
    import json

    from common.runtime.launch import free_port

    plan_file, out = root / f"{name}.json", root / f"{name}-logs"
    plan_file.write_text(json.dumps(plan))
    port = str(free_port())
    worker = Path(__file__).resolve().parent / "lab04_worker.py"
    ranks = [subprocess.Popen([PYTHON, str(worker), str(plan_file), str(out)], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=script_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1"))
             for rank in range(processes)]
    outputs = [rank.communicate(timeout=600)[0] for rank in ranks]
    costs = {step["name"]: (out / f"{step['name']}.status").read_text().split()
             for step in plan if (out / f"{step['name']}.status").exists()}
    print(f"{name}: " + ", ".join(f"{job} {cpu} s CPU / {wall} s" for job, (_, cpu, wall) in costs.items()))
    assert all(rank.returncode == 0 for rank in ranks) and len(costs) == len(plan), \
        (f"{name}: exits {[r.returncode for r in ranks]}, finished {list(costs)}\n"
         + "\n".join(o[-3000:] for o in outputs))
    return {job: int(status) for job, (status, _, _) in costs.items()}


#: Lab-03's benchmark on two CPU processes (torchrun and two Gloo ranks, DDP in training).
LAB03_DDP_ARGS = ("--device", "cpu", "-g", "2", "--models", "resnet18", "--image-size", "32", "-b", "2", "-w", "1",
                  "-n", "2", "--check-steps", "1", "--precision", "fp32", "--modes", "train", "--folder", "csv",
                  "--results-dir", "records")
