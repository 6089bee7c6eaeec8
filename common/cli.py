"""One set of command-line flags for every script (docs/conventions.md, convention 3).

``add_common_args(parser)`` adds ``--device --seed --epochs --batch-size --max-steps --dry-run
--data-dir --results-dir --num-workers`` with the same names and meaning everywhere; a script passes
its own defaults. It also accepts (and ignores) the ``--local-rank`` that ``torch.distributed.launch``
passes. Argument types reject bad values with one clear argparse error line.

This module must not import torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common.cpus import default_num_workers


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _whole_number(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _usable_place(path: Path, *, folder: bool) -> Path:
    """``path`` itself if it can be written as a folder (``folder``) or a file, else an error line.

    Nothing is created: the nearest existing ancestor must be a folder this process can write in
    (tried with a temporary file that is gone at once, which also catches read-only file systems
    and root on a read-only mount, where permission bits say nothing).
    """
    import tempfile

    if path.exists():
        if folder and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} exists and is not a folder")
        if not folder and path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a folder, expected a file path")
    ancestor = path if folder and path.is_dir() else path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {path}: {ancestor} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write under {ancestor} ({err.strerror or err})") from None
    return path


def output_dir(text: str) -> Path:
    """argparse type: a folder the run can write into (checked before anything runs; nothing created)."""
    return _usable_place(Path(text).expanduser(), folder=True)


def output_file(text: str) -> Path:
    """argparse type: a file path the run can write (checked before anything runs; nothing created)."""
    return _usable_place(Path(text).expanduser(), folder=False)


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` report a bad flag as one ``error:`` line (exit 2) instead of a usage block."""
    def error(message: str) -> None:
        parser.exit(2, f"error: {message} (see {parser.prog} --help)\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def accept_launcher_local_rank(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Accept ``--local-rank N`` / ``--local_rank N``, which ``python -m torch.distributed.launch`` passes.

    The deprecated launcher (seed 004's command) adds the flag to every process's command line; it
    also sets ``LOCAL_RANK`` in the environment, and the environment stays the source of truth
    (``common.launch.detect_launch``), so the value is accepted and not used. Hidden from ``--help``:
    torchrun is the way to start these scripts.
    """
    parser.add_argument("--local-rank", "--local_rank", dest="launcher_local_rank", type=int,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    epochs: int = 1,
    batch_size: int = 64,
    seed: int = 1,
    data_dir: str = "data",
    results_dir: str = "results",
    num_workers: int | None = None,
) -> argparse.ArgumentParser:
    """Add the flags every script shares, with the script's own defaults shown in ``--help``.

    Also switches the parser to :func:`one_line_errors`.
    """
    one_line_errors(parser)
    group = parser.add_argument_group("common options (same in every script)")
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where to run: auto picks cuda when a GPU is visible (default: %(default)s)")
    group.add_argument("--seed", type=int, default=seed, help="random seed (default: %(default)s)")
    group.add_argument("--epochs", type=positive_int, default=epochs,
                       help="number of epochs to train (default: %(default)s)")
    group.add_argument("--batch-size", type=positive_int, default=batch_size,
                       help="samples per step on each process (default: %(default)s)")
    group.add_argument("--max-steps", type=positive_int, default=None,
                       help="stop each epoch after this many steps, for tiny runs (default: whole epoch)")
    group.add_argument("--dry-run", action="store_true",
                       help="one epoch of two steps: checks that everything runs (default: off)")
    group.add_argument("--data-dir", type=Path, default=Path(data_dir),
                       help="folder holding downloaded data sets (default: %(default)s)")
    group.add_argument("--results-dir", type=output_dir, default=results_dir,
                       help="folder where the result record is written (default: %(default)s)")
    workers = default_num_workers() if num_workers is None else num_workers
    group.add_argument("--num-workers", type=non_negative_int, default=workers,
                       help="DataLoader worker processes; from SLURM_CPUS_PER_TASK when set (default: %(default)s)")
    accept_launcher_local_rank(parser)
    return parser


def apply_dry_run(args: argparse.Namespace) -> argparse.Namespace:
    """``--dry-run`` means one epoch of at most two steps."""
    if getattr(args, "dry_run", False):
        args.epochs = 1
        args.max_steps = min(args.max_steps or 2, 2)
    return args


def config_dict(args: argparse.Namespace, **derived: Any) -> dict[str, Any]:
    """The full configuration of a run for its record: every flag plus derived values."""
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    config.update(derived)
    return config
