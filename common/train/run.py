"""One object owns the plumbing of a training run, so the lesson script keeps only the lesson.

    with TrainingRun(args, lab="ch04", script=SCRIPT, method="fp32") as run:
        model = build_model(...).to(run.device)
        optimizer = ...
        run.track(model=model, optimizer=optimizer)      # what a checkpoint holds; --resume loads it here
        for epoch in run.epochs(train_loader):           # the epoch's shuffle is seeded from its number
            model.train()
            for data, target in run.steps(train_loader): # timed; skips steps a resumed run already did
                ...forward, backward, optimizer.step()...
                run.log_loss(loss)
            run.evaluated(*test(model, ...))             # optional: test loss and accuracy per epoch
        run.finish(config=splits.describe())             # rank 0 writes the record

What the run owns, so that no training script writes it again:

- **Where it runs**: the device (``--device``), CPU threads from the allocation and, with
  ``distributed=True``, the process group (``init_distributed`` on entry, ``teardown_distributed``
  on exit, NCCL on CUDA, Gloo on CPU).
- **Stopping early** (Slurm's ``--signal=B:USR1@120``, ``scancel``, pre-emption): when the run has a
  checkpoint, SIGUSR1 and SIGTERM only set a flag; at the next step all ranks agree to stop (a rank
  that stopped alone would leave the others waiting in an all-reduce), the checkpoint is saved, and
  the ``with`` block ends quietly so ``main`` returns 0 and the job can be requeued. Without a
  checkpoint, signals act as usual.
- **Checkpoints**: after every epoch and on the stop signal. The default :class:`TorchCheckpointer`
  gathers every rank's random-number state and has rank 0 write one file atomically; a
  checkpointer that writes from every rank (PyTorch Distributed Checkpoint, Lab-04) plugs in
  through the same three methods.
- **Resume** (``--resume``): load, refuse a checkpoint written with other settings (one line),
  restore the tracked objects and every rank's random generators, and continue at the step where
  the run stopped, with the same data order (each epoch's shuffle depends only on the seed and the
  epoch number; the steps already done are skipped).
- **Measuring**: step timing (warm-up dropped, device synchronised; a step starts when the loop asks
  for its batch, so waiting for the loader counts and samples/s agrees with the epoch times), the
  time spent waiting for data, what fed the loop (a DataLoader and its workers, or a data set
  resident on the device), per-step losses averaged over ranks (kept on the device until a log
  line or the end of the epoch needs them: no synchronisation per step for a loss), peak memory
  of every rank, and for DDP a hash of every replica's parameters.
- **The record**: built by :func:`common.results.training_metrics` with the metric names the schema
  documents, written by rank 0 only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import torch
from torch import nn

from common.checkpoint.single_file import (StopSignal, capture_rng_state, check_same_settings, load_checkpoint,
                               restore_rng_state, save_checkpoint)
from common.cli import apply_dry_run, config_dict, non_negative_int, output_file, positive_int
from common.data.datasets import describe_loader, set_loader_epoch
from common.runtime.device import configure_threads, describe, resolve_device, use_deterministic_algorithms
from common.runtime.distributed import (DistContext, all_reduce_mean, any_rank, gather_objects, init_distributed, print0,
                                print_rank, teardown_distributed)
from common.measure.energy import EnergyMeter
from common.errors import UserError
from common.models import replica_digests
from common.runtime.placement import record_placement
from common.results import make_record, provenance, training_metrics, write_record
from common.measure.timing import StepTimer, format_rate, peak_memory, reset_peak_memory
from common.units import format_bytes

__all__ = ["TrainingRun", "TorchCheckpointer", "Checkpointer", "Preempted", "add_checkpoint_args",
           "add_determinism_arg", "add_training_args"]

#: What a run's own progress entry holds (besides the tracked objects and the random generators).
_PROGRESS_KEYS = ("train_loss", "loss_at_step", "epoch_losses", "epoch_time_s", "eval_history", "steps",
                  "train_time_s")


def add_determinism_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--deterministic``: on a GPU, deterministic algorithms, so runs (and resumed runs) repeat bitwise.

    Adding it twice (a lab's flags and the checkpoint flags both offer it) is harmless.
    """
    if "--deterministic" in parser._option_string_actions:
        return
    parser.add_argument("--deterministic", action="store_true",
                        help="GPU only: deterministic cuDNN/cuBLAS algorithms, so a run and its resumed twin "
                             "end bitwise equal (a little slower; CPU runs are deterministic anyway) (default: off)")


def add_training_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The flags :class:`TrainingRun` reads: ``--log-interval --warmup-steps --record-steps --deterministic``.

    Every training script takes them, with the same names, meaning and defaults.
    """
    group = parser.add_argument_group("progress, timing and the record (common.train.run.TrainingRun)")
    group.add_argument("--log-interval", type=positive_int, default=10,
                       help="steps between loss lines (default: %(default)s)")
    group.add_argument("--warmup-steps", type=non_negative_int, default=2,
                       help="steps left out of the timing (default: %(default)s)")
    group.add_argument("--record-steps", type=non_negative_int, default=200,
                       help="how many of the first optimiser steps keep their loss in the record "
                            "(metrics.loss_at_step) (default: %(default)s)")
    add_determinism_arg(group)
    return group


def add_checkpoint_args(parser: argparse.ArgumentParser, *, always: bool = False) -> argparse.ArgumentParser:
    """``--checkpoint PATH`` and ``--resume``.

    ``always=True`` (the DDP scripts): without ``--checkpoint`` the run still checkpoints, to
    ``RESULTS_DIR/checkpoints/<script>.pt``, so a requeued job can resume. Otherwise a run without
    ``--checkpoint`` saves nothing and signals end it as usual.
    """
    group = parser.add_argument_group("checkpoint and resume (pre-emption safe)")
    default_text = "RESULTS_DIR/checkpoints/<script name>.pt" if always else "none: nothing is saved"
    group.add_argument("--checkpoint", type=output_file, default=None,
                       help="save here after every epoch and on SIGUSR1/SIGTERM, then exit 0 "
                            f"(default: {default_text})")
    group.add_argument("--resume", action="store_true",
                       help="continue from --checkpoint when it exists (default: start fresh)")
    add_determinism_arg(group)
    return parser


class Preempted(Exception):
    """Raised by :meth:`TrainingRun.steps` when every rank has agreed to stop before ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped before step {step}")
        self.step = step


class Checkpointer(Protocol):
    """Where and how a run's checkpoint is kept (see :class:`TorchCheckpointer`).

    ``save`` and ``read`` are called on every rank. ``reshards`` says whether a checkpoint may be
    resumed with another number of processes (the per-rank random state is then not restored).
    A checkpointer may also have ``close()``, called on every rank when the run ends, before the
    process group goes (an asynchronous save still writing needs it).
    """

    path: Path
    reshards: bool

    def save(self, state: dict[str, Any], tracked: dict[str, Any]) -> None: ...

    def read(self) -> dict[str, Any] | None: ...

    def restore(self, tracked: dict[str, Any]) -> None: ...


class TorchCheckpointer:
    """One ``torch.save`` file written by rank 0, atomically (the tracked objects are replicas)."""

    reshards = False

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._loaded: dict[str, Any] | None = None

    def save(self, state: dict[str, Any], tracked: dict[str, Any]) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        save_checkpoint({**{name: obj.state_dict() for name, obj in tracked.items()}, **state}, self.path)

    def read(self) -> dict[str, Any] | None:
        self._loaded = load_checkpoint(self.path)
        return self._loaded

    def restore(self, tracked: dict[str, Any]) -> None:
        assert self._loaded is not None, "read() first"
        for name, obj in tracked.items():
            obj.load_state_dict(self._loaded[name])


def _unwrap(model: Any) -> Any:
    """The model inside DistributedDataParallel/DataParallel (their state dicts prefix ``module.``)."""
    return model.module if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return len(first)


@dataclass
class _Progress:
    """Everything the record needs that a resumed run must carry over from the run it continues."""

    train_loss: list[float] = field(default_factory=list)      # mean over ranks, per epoch
    loss_at_step: list[float] = field(default_factory=list)    # mean over ranks, first --record-steps steps
    epoch_losses: list[float] = field(default_factory=list)    # this epoch's steps so far (mean over ranks)
    epoch_time_s: list[float] = field(default_factory=list)
    eval_history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0                                             # optimiser steps taken, all epochs
    train_time_s: float = 0.0                                  # time spent in training steps' epochs


class TrainingRun:
    """The plumbing of one training script's run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, *, lab: str, script: str, method: str,
                 distributed: bool = False, resume_settings: Iterable[str] = (),
                 checkpointer: Checkpointer | None = None) -> None:
        self.args, self.lab, self.script, self.method = args, lab, script, method
        self.distributed = distributed
        self.resume_settings = tuple(resume_settings)
        apply_dry_run(args)  # --dry-run: one epoch of at most two steps
        if getattr(args, "resume", False) and getattr(args, "checkpoint", None) is None and not distributed:
            raise UserError("--resume needs --checkpoint PATH (the file to continue from)")
        path = getattr(args, "checkpoint", None)
        if path is None and distributed and hasattr(args, "checkpoint"):
            path = Path(args.results_dir) / "checkpoints" / f"{Path(script).stem}.pt"
            output_file(str(path))  # the derived place must be usable too
            args.checkpoint = path
        self.checkpointer = checkpointer or (TorchCheckpointer(path) if path is not None else None)
        self.ctx: DistContext | None = None
        self.device = torch.device("cpu")
        self.tracked: dict[str, Any] = {}
        self.progress = _Progress()
        self.epoch, self.start_step = 1, 0
        self.stop = StopSignal()
        self.timer: StepTimer | None = None
        self.threads = 0
        self._local_losses: list[float] = []
        self._pending_losses: list[torch.Tensor] = []  # this rank's losses still on the device (no sync per step)
        self._loader: dict[str, Any] | None = None  # what fed the training loop (common.data.datasets.describe_loader)
        self._waited_s = 0.0  # time the steps this process ran spent waiting for their batch
        self._loop_s = 0.0  # wall time of the epochs' loops this process ran
        self._global_batch: int | None = None  # samples per optimiser step over all ranks
        self._current_epoch: int | None = None  # inside run.epochs()' loop body
        self._samples_run = 0  # samples of every rank through the steps this process ran (energy per sample)
        self.placement: list[dict[str, Any]] | None = None
        self.energy: EnergyMeter | None = None
        self.memory_devices: list[torch.device] = []  # where peak memory is read (default: run.device)

    # ---------------------------------------------------------------------------------- context
    def __enter__(self) -> "TrainingRun":
        self.threads = configure_threads()
        if self.distributed:
            self.ctx = init_distributed(self.args.device, force_process_group=True)
            self.device = self.ctx.device
            print_rank(f"device {describe(self.device)}")
            # Each rank's cores, its GPU's NUMA node, DataLoader workers against cores (warnings printed).
            self.placement = record_placement(self.device, getattr(self.args, "num_workers", None))
        else:
            self.device = resolve_device(self.args.device)
        if getattr(self.args, "deterministic", False):
            use_deterministic_algorithms(self.device)
        if self.checkpointer is not None:  # without a checkpoint there is nothing to save: signals act as usual
            self.stop.install()
        self.timer = StepTimer(self.device, warmup_steps=getattr(self.args, "warmup_steps", 2))
        self.energy = EnergyMeter(self.device)  # read over the training steps only (see steps())
        reset_peak_memory(self.device)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: Any) -> bool:
        try:
            if isinstance(error, Preempted):
                self._save(self.epoch, error.step)
                self.print(f"received {self.stop.name}: saved {self.checkpointer.path} at epoch {self.epoch} "
                           f"step {error.step}; exiting so the job can be requeued (resume with --resume)")
                return True
            return False
        finally:
            self.stop.restore()
            try:
                close = getattr(self.checkpointer, "close", None)
                if close is not None:  # e.g. an asynchronous save still writing: it needs the process group
                    close()
            finally:
                self.tracked.clear()  # the last references to the wrapped model and optimiser go before the group
                teardown_distributed(self.ctx)

    # ---------------------------------------------------------------------------------- who and where
    @property
    def rank(self) -> int:
        return self.ctx.rank if self.ctx else 0

    @property
    def world_size(self) -> int:
        return self.ctx.world_size if self.ctx else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *parts: Any) -> None:
        """Rank 0 speaks (flushed, so Slurm's output file keeps the order)."""
        print0(*parts)

    def describe(self) -> str:
        """One line for the start of the run: processes, backend, device, threads."""
        where = describe(self.device)
        if self.ctx is None:
            return f"device {where} | threads {self.threads}"
        return (f"{self.world_size} process(es), backend {self.ctx.backend}, launcher {self.ctx.launch.launcher} | "
                f"device {where} (rank 0) | threads {self.threads}")

    def use_devices(self, devices: list[torch.device]) -> None:
        """One process driving several GPUs (DataParallel): time on the first, report every one's memory."""
        self.device, self.memory_devices = devices[0], list(devices)
        self.timer.device = devices[0]  # each step ends on the primary GPU: synchronising it is enough
        for device in devices:
            reset_peak_memory(device)

    # ---------------------------------------------------------------------------------- checkpoints
    def track(self, **objects: Any) -> None:
        """Name what a checkpoint holds (``model=``, ``optimizer=``, ``scheduler=``, ``scaler=``...);
        with ``--resume`` and an existing checkpoint, load them back now."""
        self.tracked = {name: _unwrap(obj) for name, obj in objects.items()}
        if not getattr(self.args, "resume", False) or self.checkpointer is None:
            return
        state = self.checkpointer.read()
        if state is None:
            self.print(f"--resume: no checkpoint at {self.checkpointer.path} yet; starting fresh")
            return
        path = self.checkpointer.path
        missing = [key for key in (*self.tracked, "rng", "step", "progress") if key not in state]
        if missing:
            raise UserError(f"{path} lacks {', '.join(missing)} (written by another version of this script?); "
                            "start fresh without --resume")
        settings = {key: getattr(self.args, key) for key in self.resume_settings}
        if not self.checkpointer.reshards:
            settings["world_size"] = self.world_size
        check_same_settings(state, settings, path)
        self.checkpointer.restore(self.tracked)
        rng = state["rng"]
        if not self.checkpointer.reshards:
            restore_rng_state(rng[self.rank], self.device)  # every rank its own generators (dropout masks differ by rank)
        self.epoch, self.start_step = state["epoch"], state["step"]
        self.progress = _Progress(**{key: state["progress"][key] for key in _PROGRESS_KEYS})
        self.print(f"resumed from {path}: epoch {self.epoch}, step {self.start_step}")

    def _save(self, epoch: int, step: int) -> None:
        """Every rank calls this (the random states are gathered); the checkpointer decides who writes."""
        if self.checkpointer is None:
            return
        self._reduce_epoch_losses()
        rng = gather_objects(capture_rng_state(self.device))
        state = {"rng": rng, "epoch": epoch, "step": step, "progress": self.progress.__dict__.copy(),
                 "config": config_dict(self.args, world_size=self.world_size)}
        self.checkpointer.save(state, self.tracked)

    # ---------------------------------------------------------------------------------- the loop
    def epochs(self, loader: Any = None) -> Iterator[int]:
        """Epoch numbers from 1 (or where a resumed run stopped) to ``--epochs``.

        Before each epoch the loader's shuffle is seeded from the epoch number
        (``sampler.set_epoch``), so every rank, and a resumed run, sees the same order. After the
        loop body: the epoch's losses are averaged over ranks, the checkpoint is saved, and one
        progress line is printed.
        """
        for epoch in range(self.epoch, self.args.epochs + 1):
            self.epoch = epoch
            if loader is not None:
                set_loader_epoch(loader, epoch, self.args.seed)
            self._current_epoch = epoch
            yield epoch
            self._current_epoch = None
            self._reduce_epoch_losses()
            losses = self.progress.epoch_losses
            self.progress.train_loss.append(statistics.fmean(losses) if losses else float("nan"))
            self.progress.epoch_losses = []
            self.epoch, self.start_step = epoch + 1, 0
            self._save(epoch + 1, 0)
            self.print(self._epoch_line(epoch))

    def steps(self, loader: Iterable[Any]) -> Iterator[Any]:
        """This epoch's batches, each one timed as a training step.

        Stops after ``--max-steps``; skips the steps a resumed run already did (the order is the same,
        so they are the same batches); before each step, asks whether any rank received the stop
        signal and, if so, raises :class:`Preempted` on every rank at the same step.
        """
        total = len(loader) if self.args.max_steps is None else min(len(loader), self.args.max_steps)
        self._loader = self._loader or describe_loader(loader)
        start = time.perf_counter()
        with self.energy:  # the energy counters are read at the start and end of the epoch's steps
            yield from self._timed_steps(loader, total)
        elapsed = time.perf_counter() - start
        self.progress.epoch_time_s.append(elapsed)
        self.progress.train_time_s += elapsed
        self._loop_s += elapsed

    def _timed_steps(self, loader: Iterable[Any], total: int) -> Iterator[Any]:
        batches = iter(loader)
        for step in range(total):
            asked = time.perf_counter()
            batch = next(batches, None)  # waiting for the loader is part of the step: a starved device shows
            if batch is None:
                break
            waited = time.perf_counter() - asked
            if step < self.start_step:
                continue
            stop = self.stop.requested is not None
            if any_rank(stop, self.device) if self.distributed else stop:
                raise Preempted(step)
            logged = len(self._local_losses) + len(self._pending_losses)
            samples = _batch_size(batch) * self.world_size
            self._global_batch = self._global_batch or samples
            with self.timer.step(samples=samples, waited_s=waited):
                yield batch
            self.progress.steps += 1
            self._samples_run += samples
            self._waited_s += waited
            interval = getattr(self.args, "log_interval", 10)
            if len(self._local_losses) + len(self._pending_losses) > logged and (step % interval == 0
                                                                                 or step == total - 1):
                self._fetch_losses()  # the one synchronisation for losses between log lines
                rank0 = " (rank 0's share)" if self.world_size > 1 else ""
                self.print(f"epoch {self.epoch} step {step + 1}/{total}: loss {self._local_losses[-1]:.4f}{rank0}")

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """This step's training loss on this rank (averaged over ranks at the end of the epoch).

        A tensor stays on its device until a log line or the end of the epoch needs the number:
        reading it at once (``float(loss)``, ``loss.item()``) would make the CPU wait for the GPU
        at every step, instead of queuing the next step while the GPU works.
        """
        if isinstance(loss, torch.Tensor):
            self._pending_losses.append(loss.detach().float().reshape(()))
        else:
            self._fetch_losses()
            self._local_losses.append(float(loss))

    def _fetch_losses(self) -> None:
        """The losses still on the device, copied to the host at once (one synchronisation)."""
        if self._pending_losses:
            self._local_losses.extend(torch.stack(self._pending_losses).tolist())
            self._pending_losses = []

    def evaluated(self, test_loss: float, test_accuracy: float) -> None:
        """The held-out loss and accuracy after this epoch (kept with the training time so far)."""
        epoch = self._current_epoch or len(self.progress.train_loss)  # after the loop: the last epoch
        self.progress.eval_history.append({"epoch": epoch, "elapsed_s": self.progress.train_time_s,
                                           "test_loss": test_loss, "test_accuracy": test_accuracy})

    def _reduce_epoch_losses(self) -> None:
        """Turn this rank's losses of the steps since the last call into means over ranks (one collective)."""
        self._fetch_losses()
        losses = all_reduce_mean(self._local_losses, self.device) if self.distributed else self._local_losses
        self._local_losses = []
        self.progress.epoch_losses.extend(losses)
        keep = max(0, getattr(self.args, "record_steps", 200) - len(self.progress.loss_at_step))
        self.progress.loss_at_step.extend(losses[:keep])

    def _epoch_line(self, epoch: int) -> str:
        line = f"epoch {epoch}: train loss {self.progress.train_loss[-1]:.4f}"
        if self.progress.eval_history and self.progress.eval_history[-1]["epoch"] == epoch:
            last = self.progress.eval_history[-1]
            line += f" | test loss {last['test_loss']:.4f} | accuracy {100 * last['test_accuracy']:.2f}%"
        rate = format_rate(self.timer.summary()["samples_per_s"])
        return line + f" | {self.progress.epoch_time_s[-1]:.2f} s | {rate} samples/s" + (
            " (job)" if self.world_size > 1 else "")

    # ---------------------------------------------------------------------------------- the record
    def finish(self, *, config: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
               notes: Iterable[str] = (), method: str | None = None) -> Path | None:
        """Gather what every rank measured and have rank 0 write the record; returns its path on rank 0."""
        step_time = self.timer.summary()
        energy = self.energy.result(samples=self._samples_run or None)  # collective, like the gathers below
        memory = [entry for entries in gather_objects([{**peak_memory(device), "rank": self.rank}
                                                       for device in self.memory_devices or [self.device]])
                  for entry in entries]
        model = self.tracked.get("model")
        digests = None
        # Replicas (DDP) must end identical; sharded parameters (FSDP2's DTensors) differ by design.
        sharded = model is not None and any(hasattr(p, "to_local") for p in model.parameters())
        if self.distributed and model is not None and not sharded:
            digests = gather_objects(replica_digests(model))
            same = len({d["parameters"] for d in digests}) == 1
            self.print(f"parameters identical on all {len(digests)} rank(s): {'yes' if same else 'NO'}")
        if not self.is_main:
            return None
        last_eval = self.progress.eval_history[-1] if self.progress.eval_history else {}
        all_metrics = training_metrics(
            train_loss=self.progress.train_loss, loss_at_step=self.progress.loss_at_step,
            epoch_time_s=self.progress.epoch_time_s, step_time=step_time, steps=self.progress.steps,
            epochs=self.args.epochs, world_size=self.world_size, memory=memory,
            test_loss=last_eval.get("test_loss"), test_accuracy=last_eval.get("test_accuracy"),
            eval_history=self.progress.eval_history, replica_digests=digests, global_batch_size=self._global_batch)
        all_metrics.update(metrics or {})
        notes = list(notes)
        if digests is not None and not all_metrics["parameters_identical"]:
            notes.append("parameters differ between ranks: the replicas drifted apart (this is a bug)")
        if digests is not None and not all_metrics["buffers_identical"] and _has_batchnorm(model):
            notes.append("BatchNorm running statistics differ between ranks: each rank keeps its own unless DDP "
                         "broadcasts buffers before every forward; the checkpoint holds rank 0's")
        all_metrics["data_wait_s"] = self._waited_s  # this process's steps: waiting for their batches
        extra = {"distributed": self.ctx.describe(), "placement": self.placement} if self.ctx is not None else None
        record = make_record(lab=self.lab, script=self.script, method=method or self.method,
                             config=config_dict(self.args, resolved_device=str(self.device),
                                                global_batch_size=all_metrics["global_batch_size"],
                                                data_loader=self._loader, **(config or {})),
                             metrics=all_metrics, notes=notes, energy=energy,
                             provenance=provenance(self.device, self.world_size, extra))
        path = write_record(record, self.args.results_dir)
        accuracy = all_metrics.get("test_accuracy")
        median = step_time["median_s"]
        self.print("final: " + " | ".join(filter(None, [
            f"accuracy {100 * accuracy:.2f}%" if accuracy is not None else None,
            f"train loss {all_metrics['final_loss']:.4f}" if all_metrics["final_loss"] is not None else None,
            f"{format_rate(all_metrics['samples_per_s'])} samples/s" + (" (job)" if self.world_size > 1 else ""),
            f"median step {1000 * median:.1f} ms" if median is not None else "median step n/a (shorter than warm-up)",
            f"waiting for data {100 * self._waited_s / self._loop_s:.0f}% of the epochs" if self._loop_s else None,
        ])))
        for entry in memory:
            self.print(f"peak memory rank {entry['rank']} {entry['device']}: {format_bytes(entry['peak_bytes'])} "
                       f"({entry['source']})")
        for note in notes:
            self.print(f"note: {note}")
        if self.checkpointer is not None:
            self.print(f"checkpoint: {self.checkpointer.path}")
        self.print(f"record: {path}")
        return path
