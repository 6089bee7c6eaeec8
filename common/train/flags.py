"""The flags every training script shares, and what they settle before a run starts.

Each default is written once, here, in the parser: :class:`common.train.run.TrainingRun` and its
helpers read ``args`` and never repeat a default.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.cli import (add_log_interval_arg, add_lr_arg, apply_dry_run, config_dict, non_negative_int, output_dir,
                        output_file, positive_float, positive_int)
from common.errors import UserError

__all__ = ["RunSettings", "add_adadelta_args", "add_checkpoint_args", "add_determinism_arg",
           "add_distributed_checkpoint_args",
           "add_training_args", "settle"]


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
    """The flags :class:`~common.train.run.TrainingRun` reads: ``--log-interval --warmup-steps
    --record-steps --deterministic``. Every training script takes them, with the same names, meaning
    and defaults."""
    group = parser.add_argument_group("progress, timing and the record (common.train.run.TrainingRun)")
    add_log_interval_arg(group)
    group.add_argument("--warmup-steps", type=non_negative_int, default=2,
                       help="steps left out of the timing (default: %(default)s)")
    group.add_argument("--record-steps", type=non_negative_int, default=200,
                       help="how many of the first optimiser steps keep their loss in the record "
                            "(metrics.loss_at_step) (default: %(default)s)")
    group.add_argument("--tensorboard", type=output_dir, default=None, metavar="DIR",
                       help="write TensorBoard event files here from rank 0: train/loss per step, test/loss and "
                            "test/accuracy per evaluation (tensorboard --logdir DIR) (default: none)")
    add_determinism_arg(group)
    return group


def add_adadelta_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--lr --gamma``: the MNIST recipe of pytorch/examples (Adadelta, its learning rate decayed by StepLR
    after every epoch), which Chapter 4's and Lab-02's MNIST trainings follow."""
    add_lr_arg(parser, default=1.0, optimizer="Adadelta")
    parser.add_argument("--gamma", type=positive_float, default=0.7,
                        help="learning-rate decay per epoch (default: %(default)s)")


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
    group.add_argument("--step-budget", type=positive_int, default=None, metavar="STEPS",
                       help="optimiser steps this process may take; then it saves the checkpoint and exits 0 as "
                            "on a pre-emption signal, and --resume goes on (one link of a job chain) "
                            "(default: no budget)")
    add_determinism_arg(group)
    return parser


def add_distributed_checkpoint_args(parser: argparse.ArgumentParser, *, default_dir: str) -> argparse.ArgumentParser:
    """``--checkpoint-dir DIR``, ``--resume`` and ``--async-checkpoint``."""
    group = parser.add_argument_group("distributed checkpoint and resume (pre-emption safe)")
    group.add_argument("--checkpoint-dir", type=output_dir, default=None,
                       help="every rank writes its shards here after every epoch and on SIGUSR1/SIGTERM, then "
                            f"exits 0 (default: {default_dir})")
    group.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in --checkpoint-dir, with any number of "
                            "processes (default: start fresh)")
    group.add_argument("--async-checkpoint", action="store_true",
                       help="save with dcp.async_save: training continues while a background thread writes "
                            "(default: off, the loop waits for the files)")
    add_determinism_arg(group)
    return parser


def settle(args: argparse.Namespace, script: str, *, distributed: bool) -> Path | None:
    """Apply ``--dry-run`` and choose the checkpoint file; returns it (``None``: nothing is saved).

    A distributed script (``add_checkpoint_args(always=True)``) checkpoints even without
    ``--checkpoint``, to ``RESULTS_DIR/checkpoints/<script>.pt``, written back into ``args`` so the
    record shows it.
    """
    apply_dry_run(args)  # --dry-run: one epoch of at most two steps
    if getattr(args, "tensorboard", None) is not None and importlib.util.find_spec("tensorboard") is None:
        raise UserError("--tensorboard needs the tensorboard package, which this Python lacks (a GPU image without "
                        "the course's environment): pip install tensorboard, or leave --tensorboard out")
    if not hasattr(args, "checkpoint"):
        return None
    if args.checkpoint is None and distributed:
        args.checkpoint = output_file(str(Path(args.results_dir) / "checkpoints" / f"{Path(script).stem}.pt"))
    if args.resume and args.checkpoint is None:
        raise UserError("--resume needs --checkpoint PATH (the file to continue from)")
    if getattr(args, "step_budget", None) is not None and args.checkpoint is None:
        raise UserError("--step-budget needs --checkpoint PATH (where the next run goes on from)")
    return args.checkpoint


@dataclass(frozen=True)
class RunSettings:
    """What :class:`~common.train.run.TrainingRun` and its parts read from the command line, read once,
    after :func:`settle`: each part gets the values it needs, not the whole ``args``."""

    device: str
    deterministic: bool
    epochs: int
    max_steps: int | None
    log_interval: int
    warmup_steps: int
    record_steps: int
    resume: bool
    results_dir: Path
    checkpoint: Path | None
    step_budget: int | None    # --step-budget: steps this process may take before it saves and stops
    tensorboard: Path | None   # --tensorboard: where rank 0 writes the curves
    flags: argparse.Namespace  # every flag, for the record and the checkpoint: what the run was asked to do

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunSettings":
        return cls(device=args.device, deterministic=args.deterministic, epochs=args.epochs,
                   max_steps=args.max_steps, log_interval=args.log_interval, warmup_steps=args.warmup_steps,
                   record_steps=args.record_steps, resume=bool(getattr(args, "resume", False)),
                   results_dir=Path(args.results_dir), checkpoint=getattr(args, "checkpoint", None),
                   step_budget=getattr(args, "step_budget", None), tensorboard=getattr(args, "tensorboard", None),
                   flags=args)

    def config(self, **derived: Any) -> dict[str, Any]:
        """Every flag as the script holds it now (a script may settle some after the run starts), plus ``derived``."""
        return config_dict(self.flags, **derived)

