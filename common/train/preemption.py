"""Surviving the end of an allocation: stop on a signal, save, and resume where the run stopped.

A run may also stop by itself after ``--step-budget`` optimiser steps, exactly as on the signal (save,
exit 0): one link of a chain of jobs that each continue the run (Lab-09), with a length a test can
choose, where a time limit's signal comes only to the minute.

:class:`StopSignal` catches ``SIGUSR1`` (what ``#SBATCH --signal=B:USR1@120`` sends before the time
limit) and ``SIGTERM`` (what ``scancel`` and pre-emption send). :class:`Preemption` is the policy a
:class:`~common.train.run.TrainingRun` follows: with a checkpoint, a signal only sets a flag; before
each step every rank is asked (a rank that stopped alone would leave the others waiting in an
all-reduce), all stop at the same step (:class:`Preempted`), the checkpoint is saved and the job
exits 0 so it can be requeued. Without a checkpoint, signals act as usual.

A checkpoint is kept by a :class:`Checkpointer`: :class:`TorchCheckpointer` (one file, rank 0
writes it) or a checkpointer that writes from every rank (PyTorch Distributed Checkpoint, Lab-04's
:class:`common.checkpoint.sharded.DistributedCheckpointer`), through the same three methods.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn

from common.checkpoint.single_file import (capture_rng_state, check_same_settings, load_checkpoint,
                                           restore_rng_state, save_checkpoint)
from common.errors import Stopped, UserError
from common.results import load_records
from common.runtime.distributed import any_rank_on_host, gather_objects, print0
from common.train.progress import Progress

__all__ = ["StopSignal", "Preempted", "Checkpointer", "TorchCheckpointer", "Preemption", "unwrap", "note_fresh_start"]


def note_fresh_start(path: str | os.PathLike[str], *, resume: bool = False) -> None:
    """A run without --resume (``resume``) whose checkpoint file (or folder) holds an earlier run's: say, on rank 0,
    that this run's first save replaces it, and how to go on from it instead."""
    path = Path(path)
    if not resume and (path.is_file() or (path.is_dir() and any(path.iterdir()))):
        print0(f"starting fresh (no --resume): {path} holds an earlier run and is replaced at this run's first save; "
               "to go on from it instead: the same command with --resume")


class StopSignal:
    """Sets ``requested`` when one of ``signals`` arrives (installed by :meth:`install`)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)) -> None:
        self.signals = signals
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = signum

    def install(self) -> "StopSignal":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def name(self) -> str | None:
        return signal.Signals(self.requested).name if self.requested else None


class Preempted(Stopped):
    """Raised before ``step`` when every rank has agreed to stop; ``run_main`` exits 0 on it."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped before step {step}")
        self.step = step


class Checkpointer(Protocol):
    """Where and how a run's checkpoint is kept (see :class:`TorchCheckpointer`).

    ``save`` and ``read`` are called on every rank; ``every_rank_writes`` says whether ``save``
    writes from every rank (sharded state) or only rank 0 needs it (replicas). ``reshards``: a
    checkpoint may be resumed with another number of processes (the per-rank random state is then
    not restored). A checkpointer may also have ``close()``, called on every rank when the run
    ends, before the process group goes (an asynchronous save still writing needs it).
    """

    path: Path
    flag: str  # the command-line flag that names ``path``
    reshards: bool
    every_rank_writes: bool

    def save(self, state: dict[str, Any], tracked: dict[str, Any]) -> None: ...

    def read(self) -> dict[str, Any] | None: ...

    def restore(self, tracked: dict[str, Any]) -> None: ...


class TorchCheckpointer:
    """One ``torch.save`` file, written atomically by rank 0 (the tracked objects are replicas)."""

    flag = "--checkpoint"
    reshards = False
    every_rank_writes = False

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._loaded: dict[str, Any] | None = None

    def save(self, state: dict[str, Any], tracked: dict[str, Any]) -> None:
        """Rank 0 calls it: the replicas are identical, one file holds them."""
        save_checkpoint({**{name: obj.state_dict() for name, obj in tracked.items()}, **state}, self.path)

    def read(self) -> dict[str, Any] | None:
        self._loaded = load_checkpoint(self.path)
        return self._loaded

    def restore(self, tracked: dict[str, Any]) -> None:
        assert self._loaded is not None, "read() first"
        for name, obj in tracked.items():
            obj.load_state_dict(self._loaded[name])


def unwrap(model: Any) -> Any:
    """The model inside DistributedDataParallel/DataParallel (their state dicts prefix ``module.``)."""
    return model.module if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


class Preemption:
    """The stop flag, the checkpoint and the resume of one run (every method is called on every rank)."""

    def __init__(self, checkpointer: Checkpointer | None, *, resume: bool, budget: int | None = None) -> None:
        self.checkpointer, self.wants_resume = checkpointer, resume
        self.signal = StopSignal()
        self.budget = budget  # --step-budget: optimiser steps this process may take, then it stops as on the signal
        self.steps_taken = 0
        self.tracked: dict[str, Any] = {}

    def __enter__(self) -> "Preemption":
        if self.checkpointer is not None:  # without a checkpoint there is nothing to save: signals act as usual
            self.signal.install()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.signal.restore()
        try:
            close = getattr(self.checkpointer, "close", None)
            if close is not None:  # e.g. an asynchronous save still writing: it needs the process group
                close()
        finally:
            self.tracked.clear()  # the last references to the wrapped model and optimiser go before the group

    def check(self, step: int, *, across_ranks: bool) -> None:
        """Raise :class:`Preempted` on every rank at once if any rank received the stop signal.

        Only where the handler is armed (a checkpoint to save): otherwise a signal ends the process as
        usual and there is nothing to agree on, so no collective runs. Across ranks the flag is agreed
        between the CPUs (:func:`~common.runtime.distributed.any_rank_on_host`): no wait for the GPU."""
        if self.checkpointer is None:
            return
        stop = self.signal.requested is not None or (self.budget is not None and self.steps_taken >= self.budget)
        if any_rank_on_host(stop) if across_ranks else stop:
            raise Preempted(step)
        self.steps_taken += 1

    def why_stopped(self) -> str:
        """What stopped the run: the signal, else the step budget."""
        if self.signal.requested is not None:
            return f"received {self.signal.name}"
        return f"step budget of {self.budget} step(s) reached"

    def what_next(self, path: object, flag: str = "--checkpoint") -> str:
        """How the run goes on from the checkpoint at ``path``, in words: a job signalled before its time limit
        (SIGUSR1) requeues itself and resumes; otherwise (scancel, a time limit, ``kill``, a step budget) a new
        submission starts fresh unless it is given that checkpoint. Whatever started the training and knows better
        says it in ``HPC_DL_LABS_ON_STOP`` (a chain's next link resumes, a sweep's task is resubmitted or its sweep
        run again), and that is what a stop prints; where a signal's stop goes on otherwise, it says that in
        ``HPC_DL_LABS_ON_<SIGNAL>`` (a chain's link stopped by ``scancel``'s SIGTERM is its last:
        ``HPC_DL_LABS_ON_SIGTERM`` says how to go on, not that a next link resumes; a job too short to requeue
        itself says so in ``HPC_DL_LABS_ON_SIGUSR1``, and ``scancel`` there prints what it prints anywhere)."""
        for name in (f"HPC_DL_LABS_ON_{self.signal.name}" if self.signal.name else None, "HPC_DL_LABS_ON_STOP"):
            if name and os.environ.get(name):
                return os.environ[name]
        in_a_job = "SLURM_JOB_ID" in os.environ and self.signal.name is not None
        if in_a_job and self.signal.name == "SIGUSR1":
            return "exiting so the job can requeue itself and resume from it"
        if in_a_job:
            return f"a requeued job resumes from it; to go on in a new job: CHECKPOINT={path} sbatch <the same script>"
        return f"to go on from there: the same command with --resume {flag} {path}"

    def resume(self, objects: dict[str, Any], *, settings: dict[str, Any], rank: int, world_size: int,
               device: torch.device) -> tuple[int, int, Progress] | None:
        """Track ``objects``; with ``--resume`` and a checkpoint, load them back and return where the
        run stopped (epoch, step, progress); ``settings`` must be those the checkpoint was made with.
        ``None``: starting fresh."""
        self.tracked = {name: unwrap(obj) for name, obj in objects.items()}
        if self.checkpointer is None:
            return None
        if not self.wants_resume:  # the same command run again without --resume: say what its first save replaces
            note_fresh_start(self.checkpointer.path)
            return None
        state = self.checkpointer.read()
        path = self.checkpointer.path
        if state is None:
            print0(f"--resume: no checkpoint at {path} yet; starting fresh")
            return None
        missing = [key for key in (*self.tracked, "rng", "step", "progress") if key not in state]
        if missing:
            raise UserError(f"{path} lacks {', '.join(missing)} (written by another version of this script?); "
                            "start fresh without --resume")
        if not self.checkpointer.reshards:
            settings = {**settings, "world_size": world_size}
        check_same_settings(state, settings, path)
        self.checkpointer.restore(self.tracked)
        if not self.checkpointer.reshards:  # every rank its own generators (dropout masks differ by rank)
            restore_rng_state(state["rng"][rank], device)
        return state["epoch"], state["step"], Progress.from_dict(state["progress"])

    def past_the_end(self, epoch: int, epochs: int, steps: int, *, script: str, results_dir: Path) -> str | None:
        """After resuming at ``epoch`` (counted from 1) a run asked for ``epochs``: ``None`` when epochs are left.
        A checkpoint of more epochs than that is one line. One of the finished run stops this one (exit 0) when
        ``results_dir`` holds that run's record (this script, this checkpoint, its ``steps``); else the run goes on
        to write the record it lacks (the job ended between the last save and the record), and this is its note."""
        done, path = epoch - 1, self.checkpointer.path
        if done < epochs:
            return None
        if done > epochs:
            raise UserError(f"{path} has trained {done} epochs, more than --epochs {epochs}: give --epochs {done} or "
                            "more to go on from it, or leave out --resume to start fresh")
        records = load_records(results_dir, recursive=False).records if results_dir.is_dir() else []
        found = [record["_path"] for record in records  # --checkpoint FILE, or a sharded one's --checkpoint-dir
                 if record.get("script") == script and record["metrics"].get("steps") == steps
                 and any(isinstance(value := record["config"].get(key), str) and Path(value).resolve() ==
                         Path(path).resolve() for key in ("checkpoint", "checkpoint_dir"))]
        if found:
            again = os.environ.get("HPC_DL_LABS_TRAIN_AGAIN", "leave out --resume to train again")  # a sweep: its own
            print0(f"nothing left to train: {path} is from the run that finished its {epochs} epoch(s), and its record "
                   f"is {found[-1]} (no new record); {again}")
            raise Stopped(f"{path}: finished")
        print0(f"{path} is from a run that finished its {epochs} epoch(s) but left no record in {results_dir}: "
               "writing it now")
        return ("resumed from the checkpoint of a finished run that had left no record: nothing was trained in this "
                "process, so no step was timed (no throughput); the losses and accuracy are the finished run's")

    def state(self, epoch: int, step: int, progress: Progress, *, config: dict[str, Any],
              device: torch.device) -> dict[str, Any]:
        """The run's own part of a checkpoint: every rank's random generators (gathered: a collective,
        so every rank calls it), where to continue, the progress and the run's ``config``."""
        return {"rng": gather_objects(capture_rng_state(device)), "epoch": epoch, "step": step,
                "progress": progress.as_dict(), "config": config}
