"""One object owns the plumbing of a training run, so the lesson script keeps only the lesson.

    with TrainingRun(args, lab="ch04", script=SCRIPT, method="fp32") as run:
        model = build_model(...).to(run.device)
        optimizer = ...
        run.track(model=model, optimizer=optimizer)      # what a checkpoint holds; --resume loads it here
        for epoch in run.epochs():
            sampler.set_epoch(epoch)                     # the epoch's shuffle, seeded from its number
            model.train()
            for data, target in run.steps(train_loader): # timed; skips steps a resumed run already did
                ...forward, backward, optimizer.step()...
                run.log_loss(loss)
            run.evaluated(*test(model, ...))             # optional: test loss and accuracy per epoch
            run.save_checkpoint()                        # collective; when the run has one (--checkpoint)
        run.finish(config=splits.describe())             # collective; rank 0 writes the record

The flags it reads are read once, into :class:`common.train.flags.RunSettings`, and each part gets
the values it needs; ``args`` itself only goes into the record and the checkpoint (what the run was
asked to do). Its collectives, on a distributed run: ``steps`` agrees on a stop signal once per step
where a handler is armed (a checkpoint to save: one Gloo all-reduce of one number, no wait for the
GPU), ``epochs`` averages each epoch's losses over the ranks, ``save_checkpoint``,
``checkpoint_state`` and ``finish`` gather from every rank. Every rank calls them; one called on rank
0 alone ends within the collective timeout, naming the ranks that did not come.

The run delegates each of its jobs to one collaborator:

- **where it runs**: :func:`common.runtime.distributed.open_process` (the device from ``--device``,
  CPU threads from the allocation and, with ``distributed=True``, the process group: NCCL on CUDA,
  Gloo on CPU), torn down on exit;
- **stopping and resuming**: :class:`common.train.preemption.Preemption` (SIGUSR1/SIGTERM set a
  flag, all ranks stop at the same step, the checkpoint is saved, and
  :class:`~common.train.preemption.Preempted` goes on to ``common.errors.run_main``, which exits 0 so
  the job can be requeued; ``--resume`` restores the tracked objects and every rank's random
  generators, and the steps already done are skipped: each epoch's order
  depends only on the seed and the epoch number);
- **what it learned**: :class:`common.train.progress.Progress` and ``LossLog`` (per-step losses
  kept on the device, averaged over ranks per epoch, the held-out history);
- **measuring**: :class:`common.train.meter.RunMeter` (step time, data waiting, energy, memory,
  placement);
- **the curves**: :class:`common.train.progress.Curves` (``--tensorboard DIR``: TensorBoard event files);
- **the record**: :func:`common.train.record.write_run_record` (rank 0 writes it).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Iterable, Iterator

import torch

from common.runtime.distributed import every_rank_arrives, open_process, print0, teardown_distributed
from common.train.flags import RunSettings, settle
from common.train.meter import RunMeter
from common.train.preemption import Checkpointer, Preempted, Preemption, TorchCheckpointer
from common.train.progress import Curves, LossLog, Progress
from common.train.record import write_run_record

__all__ = ["TrainingRun"]


class TrainingRun:
    """The plumbing of one training script's run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, *, lab: str, script: str, method: str,
                 distributed: bool = False, resume_settings: Iterable[str] = (),
                 checkpointer: Checkpointer | None = None) -> None:
        self.lab, self.script, self.method = lab, script, method
        self.distributed, self.resume_settings = distributed, tuple(resume_settings)
        path = settle(args, script, distributed=distributed)  # --dry-run, --resume, where the checkpoint goes
        self.settings = RunSettings.from_args(args)  # what the run's parts read, once; args itself goes to the record
        self.checkpointer = checkpointer or (TorchCheckpointer(path) if path is not None else None)
        self.preemption = Preemption(self.checkpointer, resume=self.settings.resume, budget=self.settings.step_budget)
        self.progress = Progress()
        self.losses = LossLog(self.settings.record_steps)
        self.epoch, self.start_step, self._epoch_open = 1, 0, False
        self.notes: list[str] = []  # the run's own notes for the record, beside the script's
        self.whole_epochs_from = 1  # the first epoch this process runs whole (a resumed run: after the checkpoint's)

    def __enter__(self) -> "TrainingRun":
        self.ctx = open_process(self.settings.device, distributed=self.distributed,
                                deterministic=self.settings.deterministic)
        self.device = self.ctx.device
        self.curves = Curves(self.settings.tensorboard, is_main=self.is_main)  # --tensorboard
        self.meter = RunMeter(self.device, warmup_steps=self.settings.warmup_steps)
        self.preemption.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: Any) -> bool:
        try:
            if isinstance(error, Preempted):  # saved here; the exception goes on (run_main exits 0 on it)
                self.save_checkpoint(self.epoch, error.step)
                saved = self.checkpointer
                self.print(f"{self.preemption.why_stopped()}: saved {saved.path} at epoch {self.epoch} step "
                           f"{error.step}; {self.preemption.what_next(saved.path, saved.flag)}")
            return False
        finally:
            try:
                self.curves.close()
                self.preemption.__exit__()
            finally:
                teardown_distributed(self.ctx)

    # ---------------------------------------------------------------------------------- who and where
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *parts: Any) -> None:
        print0(*parts)  # rank 0 speaks (flushed, so Slurm's output file keeps the order)

    def describe(self) -> str:
        return self.ctx.line(distributed=self.distributed)  # processes, backend, device, threads

    def use_devices(self, devices: list[torch.device]) -> None:
        """One process driving several GPUs (DataParallel): time on the first, report every one's memory."""
        self.device = devices[0]
        self.meter.use_devices(devices)

    # ---------------------------------------------------------------------------------- checkpoints
    def track(self, **objects: Any) -> None:
        """Name what a checkpoint holds (``model=``, ``optimizer=``, ``scheduler=``, ``scaler=``...);
        with ``--resume`` and an existing checkpoint, load them back now."""
        # The settings a checkpoint must have been made with, as the script has them now.
        settings = {key: getattr(self.settings.flags, key) for key in self.resume_settings}
        resumed = self.preemption.resume(objects, settings=settings, rank=self.rank, world_size=self.world_size,
                                         device=self.device)
        if resumed is not None:
            self.epoch, self.start_step, self.progress = resumed
            self.whole_epochs_from = self.epoch + (self.start_step > 0)
            # First whether anything is left to train: a finished run stops with its own line, not a "resumed" one.
            finished = self.preemption.past_the_end(self.epoch, self.settings.epochs, self.progress.steps,
                                                    script=self.script, results_dir=self.settings.results_dir)
            self.print(f"resumed from {self.checkpointer.path}: epoch {self.epoch}, step {self.start_step}")
            self.notes += [finished] if finished else []  # a finished run with its record stops there (exit 0)

    def checkpoint_state(self) -> dict[str, Any]:
        """A one-file checkpoint after this epoch, for a script that writes it itself: the tracked state dicts
        (the model unwrapped from DDP) and every rank's random generators. A collective: every rank calls it
        (called on rank 0 alone it ends within the collective timeout, naming the ranks that did not come)."""
        self._every_rank_here("checkpoint_state()")
        state = self._run_state(None, 0)
        return {**{name: obj.state_dict() for name, obj in self.preemption.tracked.items()}, **state}

    def save_checkpoint(self, epoch: int | None = None, step: int = 0) -> None:
        """A collective: every rank calls it (by default after the epoch); rank 0 writes, or every rank if
        sharded. Called under ``if run.is_main:`` it ends within the collective timeout, naming the ranks
        that never came, instead of hanging."""
        if self.checkpointer is not None:
            self._every_rank_here("save_checkpoint()")
            state = self._run_state(epoch, step)
            if self.is_main or self.checkpointer.every_rank_writes:
                self.checkpointer.save(state, self.preemption.tracked)

    def _every_rank_here(self, what: str) -> None:
        if self.distributed:
            every_rank_arrives(what, self.ctx)

    def _run_state(self, epoch: int | None, step: int) -> dict[str, Any]:
        self._close_epoch(ended=epoch is None)  # the epoch is over unless a signal stopped it at ``step``
        return self.preemption.state(self.epoch + 1 if epoch is None else epoch, step, self.progress,
                                     config=self.settings.config(world_size=self.world_size), device=self.device)

    # ---------------------------------------------------------------------------------- the loop
    def epochs(self) -> Iterator[int]:
        """Epoch numbers from 1 (or where a resumed run stopped) to ``--epochs``; after each one, its
        losses are averaged over ranks and one progress line is printed."""
        for epoch in range(self.epoch, self.settings.epochs + 1):
            self.epoch, self._epoch_open = epoch, True
            yield epoch
            self._close_epoch(ended=True)
            self.epoch, self.start_step = epoch + 1, 0
            self.print(self.progress.line(epoch, self.meter.rate(), job=self.world_size > 1))

    def _close_epoch(self, *, ended: bool) -> None:
        logged = len(self.progress.epoch_losses)
        self.losses.reduce_into(self.progress, self.device, across_ranks=self.distributed)
        self.curves.losses(self.progress.steps, self.progress.epoch_losses[logged:])
        if ended and self._epoch_open:
            self.progress.close_epoch()
            self._epoch_open = False

    def steps(self, loader: Iterable[Any], *, loader_resumes: bool = False) -> Iterator[Any]:
        """This epoch's batches, each one timed as a step, up to ``--max-steps``. Skips the steps a resumed run
        did (the same batches: the order is the same); stops every rank at once if any got the stop signal.

        ``loader_resumes=True``: the loader keeps its own position and the checkpoint holds it (Lab-08's
        ``StatefulDataLoader``, tracked with :meth:`track`); a resumed run takes its next batch as it is,
        numbered from the step it stopped at. The stop is agreed before a batch is taken, so such a loader
        has not yet handed out the batch a resumed run must start with."""
        if self.distributed and self.meter.placement is None:  # each rank's cores, its GPU's NUMA node, and the
            self.meter.place(getattr(loader, "num_workers", None))  # workers of the loader it has (none if resident)
        cap = self.settings.max_steps
        total = len(loader) if cap is None else min(len(loader), cap)
        with self.meter.epoch(loader):
            batches = iter(loader)
            for step in range(self.start_step if loader_resumes else 0, total):
                if step >= self.start_step:
                    self.preemption.check(step, across_ranks=self.distributed)  # a collective where a handler is armed
                asked = time.perf_counter()
                batch = next(batches, None)  # waiting for the loader is part of the step: a starved device shows
                if batch is None:
                    break
                if step < self.start_step:
                    continue
                logged = len(self.losses)
                with self.meter.step(batch, world_size=self.world_size, waited_s=time.perf_counter() - asked):
                    yield batch
                self.progress.steps += 1
                if len(self.losses) > logged and (step % self.settings.log_interval == 0 or step == total - 1):
                    rank0 = " (rank 0's share)" if self.world_size > 1 else ""
                    self.print(f"epoch {self.epoch} step {step + 1}/{total}: loss {self.losses.latest():.4f}{rank0}")
        self.progress.epoch_time_s.append(self.meter.last_epoch_s)
        self.progress.train_time_s += self.meter.last_epoch_s

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """This step's training loss on this rank (kept on its device; averaged over ranks per epoch)."""
        self.losses.add(loss)

    def evaluated(self, test_loss: float, test_accuracy: float) -> None:
        """The held-out loss and accuracy after this epoch (kept with the training time so far)."""
        epoch = self.epoch if self._epoch_open else len(self.progress.train_loss)  # after the loop: the last
        self.progress.evaluated(epoch, test_loss, test_accuracy)
        self.curves.evaluated(self.progress.steps, test_loss, test_accuracy)

    # ---------------------------------------------------------------------------------- the record
    def finish(self, *, config: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
               notes: Iterable[str] = (), method: str | None = None) -> Any:
        """Gather what every rank measured and have rank 0 write the record; returns its path on rank 0."""
        return write_run_record(lab=self.lab, script=self.script, method=method or self.method, ctx=self.ctx,
                                distributed=self.distributed, progress=self.progress, meter=self.meter,
                                model=self.preemption.tracked.get("model"),
                                config=self.settings.config(**(config or {})),  # the flags as the script ran
                                metrics=metrics or {}, notes=[*self.notes, *notes], epochs=self.settings.epochs,
                                results_dir=self.settings.results_dir,
                                checkpoint=None if self.checkpointer is None else self.checkpointer.path,
                                whole_epochs_from=self.whole_epochs_from)
