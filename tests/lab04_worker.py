"""Run several script invocations one after the other in one distributed job, sharing its process group.

Every rank of a launch imports torch and joins a rendezvous, seconds each on the CI machine; the
Lab-04 and Lab-07 tests need a dozen distributed runs each, so they share one launch per world size
(``helpers.launch_plan`` starts the ranks the way torchrun does, with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set, without torchrun's own agent process)::

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/lab04_worker.py PLAN.json OUT

``PLAN.json`` lists the runs, in order: ``{"name", "script", "argv"}`` and optionally
``"signal_during_step": K`` (rank 0 raises SIGUSR1 while training step K, counted from 0 over the
run, is under way: a pre-emption arriving mid-epoch) and ``"copy_before": [SOURCE, TARGET]`` (rank 0
copies the folder SOURCE, e.g. a checkpoint an earlier run saved, to TARGET before the run starts).
Each run calls the script's ``main(argv)`` the way its ``__main__`` does; the scripts find the
worker's process group and use it (and leave it to the worker to tear down). ``OUT/<name>.log`` gets
rank 0's output, ``OUT/<name>.rank<R>.log`` the other ranks', and ``OUT/<name>.status`` the exit
status, rank 0's CPU seconds and wall seconds.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from helpers import load_script, signalling_timer  # noqa: E402


def run_one(job: dict, rank: int, out: Path) -> int:
    import common.train.meter
    from common.errors import run_main

    if job.get("copy_before"):
        import shutil

        import torch.distributed as dist

        if rank == 0:
            shutil.copytree(*job["copy_before"])
        dist.barrier()  # no rank starts before the copy is complete
    module = load_script(job["script"])
    log = out / (f"{job['name']}.log" if rank == 0 else f"{job['name']}.rank{rank}.log")
    original = common.train.meter.StepTimer
    if rank == 0 and job.get("signal_during_step") is not None:
        common.train.meter.StepTimer = signalling_timer(original, during_step=job["signal_during_step"])
    try:
        with open(log, "w") as handle, contextlib.redirect_stdout(handle), contextlib.redirect_stderr(handle):
            try:
                run_main(module.main, job["argv"])
            except SystemExit as exit_:
                return int(exit_.code or 0)
        return 0
    finally:
        common.train.meter.StepTimer = original


def main() -> int:
    from common.runtime.distributed import init_distributed, teardown_distributed

    plan, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    ctx = init_distributed("cpu", force_process_group=True)
    try:
        for job in plan:
            began, cpu = time.perf_counter(), time.process_time()
            status = run_one(job, ctx.rank, out)
            if ctx.rank == 0:
                cost = f"{status} {time.process_time() - cpu:.2f} {time.perf_counter() - began:.2f}"
                (out / f"{job['name']}.status").write_text(cost)
                print(f"lab04 worker: {job['name']} exited {status}", flush=True)
    finally:
        teardown_distributed(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
