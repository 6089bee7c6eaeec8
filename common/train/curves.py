"""Loss and accuracy curves as TensorBoard event files: ``--tensorboard DIR``, written by rank 0.

``train/loss`` at every optimiser step (the mean over ranks: the numbers of the record's
``loss_at_step``), ``test/loss`` and ``test/accuracy`` at every evaluation, each at the run's global
step (one logged loss per step). The losses are written when the end of an epoch (or a checkpoint)
brings them to the CPU anyway, so the flag adds no synchronisation per step. A resumed run adds an
event file to the same folder and goes on from the step it resumed at; TensorBoard joins them.
``tensorboard --logdir DIR`` shows them (on a cluster: see Lab-09's README).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["Curves"]


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
