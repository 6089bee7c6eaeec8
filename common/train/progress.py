"""What a training run has learned so far: losses per step and per epoch, the held-out history.

:class:`Progress` is what the record needs and what a resumed run must carry over from the run it
continues (it goes into the checkpoint as a dict). :class:`LossLog` keeps this rank's step losses
on the device until a log line or the end of the epoch needs them, then averages them over ranks.
:class:`Curves` writes the same numbers as TensorBoard event files (``--tensorboard DIR``, rank 0):
``train/loss`` at every optimiser step (the record's ``loss_at_step``), ``test/loss`` and
``test/accuracy`` at every evaluation, each at the run's global step (one logged loss per step).
The losses are written when the end of an epoch (or a checkpoint) brings them to the CPU anyway,
so the flag adds no synchronisation per step. A resumed run adds an event file to the same folder
and goes on from the step it resumed at; TensorBoard joins them (``tensorboard --logdir DIR``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from common.runtime.distributed import all_reduce_mean

__all__ = ["Progress", "LossLog", "Curves"]


@dataclass
class Progress:
    """Everything the record needs that a resumed run must carry over from the run it continues."""

    train_loss: list[float | None] = field(default_factory=list)  # mean over ranks, per epoch (None: no loss logged)
    loss_at_step: list[float] = field(default_factory=list)    # mean over ranks, first --record-steps steps
    epoch_losses: list[float] = field(default_factory=list)    # this epoch's steps so far (mean over ranks)
    epoch_time_s: list[float] = field(default_factory=list)
    eval_history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0                                             # optimiser steps taken, all epochs
    train_time_s: float = 0.0                                  # time spent in training steps' epochs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "Progress":
        """The progress a checkpoint holds (keys this version does not know are left out)."""
        return cls(**{key: saved[key] for key in cls.__dataclass_fields__})

    def close_epoch(self) -> None:
        """The epoch's mean loss goes into ``train_loss`` (``None`` when the epoch logged none: a loader read
        alone trains nothing, and "train loss nan" would say it diverged); the next epoch starts empty."""
        self.train_loss.append(statistics.fmean(self.epoch_losses) if self.epoch_losses else None)
        self.epoch_losses = []

    def line(self, epoch: int, rate: str, *, job: bool) -> str:
        """The progress line after ``epoch``: its loss, the held-out numbers, its time, and samples/s of the timed
        steps so far (every epoch's, warm-up left out: the run's figure as it builds up, not this epoch's alone)."""
        loss = self.train_loss[-1]
        line = f"epoch {epoch}: " + ("no loss logged" if loss is None else f"train loss {loss:.4f}")
        last = self.eval_history[-1] if self.eval_history else None
        if last is not None and last["epoch"] == epoch:
            line += f" | test loss {last['test_loss']:.4f} | accuracy {100 * last['test_accuracy']:.2f}%"
        return line + f" | {self.epoch_time_s[-1]:.2f} s | {rate} samples/s so far" + (" (job)" if job else "")

    def evaluated(self, epoch: int, test_loss: float, test_accuracy: float) -> None:
        self.eval_history.append({"epoch": epoch, "elapsed_s": self.train_time_s,
                                  "test_loss": test_loss, "test_accuracy": test_accuracy})


class LossLog:
    """This rank's step losses: on the device until needed, then into :class:`Progress` as means over ranks."""

    def __init__(self, record_steps: int) -> None:
        self.record_steps = record_steps
        self._local: list[float] = []
        self._pending: list[torch.Tensor] = []  # still on the device: no synchronisation per step

    def __len__(self) -> int:
        return len(self._local) + len(self._pending)

    def add(self, loss: torch.Tensor | float) -> None:
        """A tensor stays on its device: reading it at once (``loss.item()``) would make the CPU wait
        for the GPU at every step instead of queuing the next one while the GPU works."""
        if isinstance(loss, torch.Tensor):
            self._pending.append(loss.detach().float().reshape(()))
        else:
            self._fetch()
            self._local.append(float(loss))

    def latest(self) -> float:
        """This rank's last loss (one synchronisation for every loss logged since the last call)."""
        self._fetch()
        return self._local[-1]

    def _fetch(self) -> None:
        if self._pending:
            self._local.extend(torch.stack(self._pending).tolist())
            self._pending = []

    def reduce_into(self, progress: Progress, device: torch.device, *, across_ranks: bool) -> None:
        """The losses since the last call, averaged over ranks (one collective), into ``progress``."""
        self._fetch()
        losses = all_reduce_mean(self._local, device) if across_ranks else self._local
        self._local = []
        progress.epoch_losses.extend(losses)
        keep = max(0, self.record_steps - len(progress.loss_at_step))
        progress.loss_at_step.extend(losses[:keep])


class Curves:
    """The run's TensorBoard writer on rank 0 when ``log_dir`` is set; every method does nothing otherwise."""

    def __init__(self, log_dir: Path | None, *, is_main: bool) -> None:
        self.writer = None
        if log_dir is not None and is_main:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard (~1 s): only when asked

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def losses(self, last_step: int, losses: Sequence[float]) -> None:
        """The training losses of the steps that end at global step ``last_step``."""
        if self.writer is not None:
            for offset, loss in enumerate(losses, start=last_step - len(losses) + 1):
                self.writer.add_scalar("train/loss", loss, offset)

    def evaluated(self, step: int, test_loss: float, test_accuracy: float) -> None:
        if self.writer is not None:
            self.writer.add_scalar("test/loss", test_loss, step)
            self.writer.add_scalar("test/accuracy", test_accuracy, step)
            self.writer.flush()  # a status command may read the curves while the run goes on

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
