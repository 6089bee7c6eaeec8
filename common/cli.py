"""One set of command-line flags for every script (docs/conventions.md, convention 3).

``script_parser(__doc__)`` makes a script's parser (the docstring's first paragraph as description,
one-line errors). ``add_common_args(parser)`` adds ``--device --seed --epochs --batch-size
--max-steps --dry-run --data-dir --results-dir --num-workers`` with the same names and meaning
everywhere; a script passes
its own defaults; a script that does not train (a benchmark) takes ``add_run_args(parser)``, the
``--device --seed --dry-run --results-dir`` part. Both also accept (and ignore) the ``--local-rank``
that ``torch.distributed.launch`` passes. Argument types reject bad values with one clear argparse
error line. A path flag takes one of the path types (:func:`input_dir`, :func:`input_file`,
:func:`output_dir`, :func:`output_file`; :func:`input_path` where either kind is right): a file where
a folder belongs, a folder where a file belongs, or a place that cannot be written is that one line
too, before anything is written.

The names that some flags choose between live here too, once: Lab-02's input pipelines and data sets
(``--pipeline``, ``--dataset``: :func:`add_dataset_args`), and Lab-03's precisions and modes
(:data:`BENCHMARK_PRECISIONS`, :data:`BENCHMARK_MODES`), which its report section lays out in the
same order. A script that starts others as processes (Lab-02's ``sweep.py``) offers the same flags
without importing torch.

This module must not import torch (2-4 s): parsers and the report read it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from common.errors import first_rank
from common.runtime.cpus import default_num_workers, usable_cpus

#: The most DataLoader workers ``--num-workers`` takes per CPU this process may use (:func:`worker_count`).
WORKERS_PER_CPU = 4


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


def seed_int(text: str) -> int:
    """argparse type: a random seed, as ``torch.manual_seed`` takes one (64 bits; a negative one counts from 2**64)."""
    value = _whole_number(text, -2**63)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"must be at most 2**64 - 1 ({2**64 - 1}), got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _whole_number(text, 0)


def worker_count(text: str) -> int:
    """argparse type: DataLoader worker processes, from 0 (the main process loads) to :data:`WORKERS_PER_CPU` per CPU
    this process may use (its affinity mask, which Slurm narrows). A few more workers than CPUs can hide slow reads;
    ``--num-workers 1000`` started a thousand processes, each with its own copy of the data set, before the first
    batch."""
    value = _whole_number(text, 0)
    usable = usable_cpus()
    if value > WORKERS_PER_CPU * usable:
        raise argparse.ArgumentTypeError(f"must be at most {WORKERS_PER_CPU * usable} ({WORKERS_PER_CPU} per CPU; "
                                         f"this process may use {usable}), got {value}")
    return value


def percent_int(text: str) -> int:
    """argparse type: an integer from 1 to 100 (a JPEG quality, a percentage)."""
    value = _whole_number(text, 1)
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be at most 100, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _finite_number(text, above_zero=True)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _finite_number(text, above_zero=False)


def _finite_number(text: str, *, above_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 if above_zero else value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a {'positive number' if above_zero else 'number >= 0'}, got {text}")
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
        raise argparse.ArgumentTypeError(f"cannot write {path}: nothing can be created in {ancestor} "
                                         f"({err.strerror or err})") from None
    return path


def input_dir(text: str) -> Path:
    """argparse type: a folder the run reads. A file there is an error line; a folder that does not
    exist is left to the script, which says what belongs in it (a data set, records)."""
    path = _given_path(text, "folder")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file, expected a folder")
    return path


def input_file(text: str) -> Path:
    """argparse type: a file the run reads. A folder there is an error line; a missing file is left to
    the script, which says where it comes from."""
    path = _given_path(text, "file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, expected a file")
    return path


def input_path(text: str) -> Path:
    """argparse type: a file or a folder the run reads, either being right (``render_sbatch.py``'s
    templates: one file, or with ``--all-sites`` folders of them); the script checks which it got."""
    return _given_path(text, "file or folder")


def from_here(path: Path) -> str:
    """``path`` as the user can type it where they are: relative to the working folder inside the course's repository
    (``../../scripts/x.py`` from a lab's folder), absolute from anywhere else."""
    repository, here = Path(__file__).resolve().parents[1], Path.cwd().resolve()
    return os.path.relpath(path) if here == repository or repository in here.parents else str(Path(path).resolve())


def _given_path(text: str, what: str) -> Path:
    """``text`` as a path; an empty one (``--results-dir ""``, a variable that was not set) is an error line, not the
    current folder, which is what ``Path("")`` means."""
    if not text.strip():
        here = " ('.' for the current one)" if what == "folder" else ""
        raise argparse.ArgumentTypeError(f"an empty path: give a {what}{here}")
    return Path(text).expanduser()


def output_dir(text: str) -> Path:
    """argparse type: a folder the run can write into (checked before anything runs; nothing created)."""
    return _usable_place(_given_path(text, "folder"), folder=True)


def output_file(text: str) -> Path:
    """argparse type: a file path the run can write (checked before anything runs; nothing created)."""
    _no_folder_slash(text)
    return _usable_place(_given_path(text, "file path"), folder=False)


def _no_folder_slash(text: str) -> None:
    """``-o build/`` means a folder: Path drops the slash, and the run would write a file called ``build``."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text} ends in /, which names a folder: give a file path")


def output_file_or_name(text: str) -> Path:
    """argparse type: a file path the run can write, as :func:`output_file`, or a bare file name, which the script
    places elsewhere and checks there (the report puts ``r.html`` into RESULTS_DIR, not where it was typed)."""
    _no_folder_slash(text)
    path = _given_path(text, "file name or path")
    return path if len(path.parts) == 1 and path.name not in (".", "..") else output_file(text)


def unknown_names(what: str, unknown: list[str], valid: list[str],
                  same: Callable[[str], str] | None = None) -> str:
    """``unknown models 'resnt18'; did you mean resnet18?``: another spelling of a name (``same`` maps each to one
    name: Lab-03's ``fp16`` is ``half`` or ``amp-fp16``) or close ones; all of ``valid`` only when they are few."""
    near: list[str] = []
    for name in unknown:
        spellings = [v for v in valid if same is not None and v != name and same(v) == same(name)]
        near += [v for v in spellings or difflib.get_close_matches(name, valid, n=4, cutoff=0.6) if v not in near]
    if near:
        choices = f"did you mean {' or '.join(near)}?"
    elif len(valid) <= 12:
        choices = f"valid {what}: {', '.join(valid)}"
    else:
        choices = f"none of the {len(valid)} valid ones is close ({', '.join(valid[:5])}, ...)"
    return f"unknown {what} {', '.join(map(repr, unknown))}; {choices}"


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` report a bad flag as one ``error:`` line (exit 2) instead of a usage block; a folder typed
    where no positional argument is taken gets the flag it needs (``compare_results.py results``)."""
    def error(message: str) -> None:
        extra = message.removeprefix("unrecognized arguments: ").split() if "unrecognized arguments: " in message \
            else []
        folder = next((word for word in extra if not word.startswith("-") and Path(word).is_dir()), None)
        flags = parser._option_string_actions  # a script that reads its folder of records, not a training's data
        hint = f"; a folder is given as --results-dir {folder}" if folder and "--results-dir" in flags and \
            "--data-dir" not in flags else ""
        if not first_rank():  # every rank has the same flags: under torchrun or srun the first says it
            parser.exit(2)
        parser.exit(2, f"error: {message}{hint} (see {parser.prog} --help)\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def refuse_unused(parser: argparse.ArgumentParser, args: argparse.Namespace, used: bool, where: str,
                  *dests: str) -> None:
    """One ``error:`` line (exit 2) when a flag of ``dests`` was given another value than its default and this run
    does not use it (``used`` false; ``where`` says when it would): an ignored flag looks as if it did something."""
    given = [f"--{dest.replace('_', '-')}" for dest in dests if getattr(args, dest) != parser.get_default(dest)]
    if given and not used:
        parser.error(f"{' and '.join(given)}: only with {where}")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that adds every flag's default to its help, a switch's said as on or off (not False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or "") or action.default is argparse.SUPPRESS:  # said already, or --help
            return action.help
        if action.nargs == 0:
            return f"{action.help} (default: {'on' if action.default else 'off'})"
        return super()._get_help_string(action)


def script_parser(doc: str | None, *,
                  formatter_class: type[argparse.HelpFormatter] = argparse.RawDescriptionHelpFormatter,
                  ) -> argparse.ArgumentParser:
    """The parser of a course script: the first paragraph of its docstring (``doc``) as the
    description, printed as written, and a bad flag reported as one ``error:`` line (:func:`one_line_errors`)."""
    return one_line_errors(argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                                   formatter_class=formatter_class))


def accept_launcher_local_rank(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Accept ``--local-rank N`` / ``--local_rank N``, which ``python -m torch.distributed.launch`` passes.

    The deprecated launcher (the Chapter 16 notes' command) adds the flag to every process's command line; it
    also sets ``LOCAL_RANK`` in the environment, and the environment stays the source of truth
    (``common.runtime.launch.detect_launch``), so the value is accepted and not used. Hidden from ``--help``:
    torchrun is the way to start these scripts.
    """
    parser.add_argument("--local-rank", "--local_rank", dest="launcher_local_rank", type=int,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def add_run_args(
    parser: argparse.ArgumentParser,
    *,
    seed: int | None = 1,
    results_dir: str = "results",
    dry_run: str | None = "one epoch of two steps: checks that everything runs",
    device: bool = True,
) -> argparse._ArgumentGroup:
    """Add the flags of every script, training or not: ``--device --seed --dry-run --results-dir``.

    A script that does not train (a benchmark) takes these alone; :func:`add_common_args` adds the
    training flags to the same group. ``dry_run`` says what ``--dry-run`` does in this script. The
    helps name their defaults through ``%(default)s``, so they read the same with or without
    ``argparse.ArgumentDefaultsHelpFormatter``. Also switches the parser to :func:`one_line_errors`
    and accepts the ``--local-rank`` of the old launcher. A script that draws nothing at random (``seed=None``),
    has no shorter run (``dry_run=None``) or computes on no device (``device=False``) is not offered that flag.
    """
    one_line_errors(parser)
    group = parser.add_argument_group("common options (the same meaning in every script)")
    if device:
        group.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                           help="where to run: auto picks cuda when a GPU is visible (default: %(default)s)")
    if seed is not None:
        group.add_argument("--seed", type=seed_int, default=seed, help="random seed (default: %(default)s)")
    if dry_run is not None:
        group.add_argument("--dry-run", action="store_true", help=f"{dry_run} (default: off)")
    group.add_argument("--results-dir", type=output_dir, default=results_dir,
                       help="folder where the result records are written (default: %(default)s)")
    accept_launcher_local_rank(parser)
    return group


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    epochs: int | None = 1,
    batch_size: int = 64,
    seed: int = 1,
    data_dir: str | None = "data",
    results_dir: str = "results",
    num_workers: int | None = None,
    min_workers: int = 0,
    epochs_and_steps: bool = True,
    data: bool = True,
    workers: bool = True,
    dry_run: str | None = None,
) -> argparse.ArgumentParser:
    """Add the flags every training script shares, with the script's own defaults shown in ``--help``.

    Those of :func:`add_run_args`, then ``--epochs --batch-size --max-steps --data-dir --num-workers``. A script
    without epochs (a profiler's fixed number of steps) leaves out ``--epochs --max-steps`` with
    ``epochs_and_steps=False``, one without a data set ``--data-dir --num-workers`` with ``data=False``, one whose data
    come with the code (a DataLoader all the same) ``--data-dir`` with ``data_dir=None``, one that trains a fixed
    number of epochs ``--epochs`` with ``epochs=None``, one whose loaders have fixed workers ``--num-workers`` with
    ``workers=False``: a flag that would change nothing is not offered. ``num_workers`` fixes ``--num-workers``'
    default, else it is the allocation's (``common.runtime.cpus.default_num_workers``), at least ``min_workers``.
    ``dry_run`` says what ``--dry-run`` does where it is not one epoch of two steps (a script without epochs).
    """
    if dry_run is None:
        dry_run = ("one epoch of two steps: checks that everything runs" if epochs_and_steps else
                   "the script's smallest settings, each count capped: checks that everything runs")
    group = add_run_args(parser, seed=seed, results_dir=results_dir, dry_run=dry_run)
    if epochs_and_steps and epochs is not None:
        group.add_argument("--epochs", type=positive_int, default=epochs,
                           help="number of epochs to train (default: %(default)s)")
    group.add_argument("--batch-size", type=positive_int, default=batch_size,
                       help="samples per step on each process (default: %(default)s)")
    if epochs_and_steps:
        group.add_argument("--max-steps", type=positive_int, default=None,
                           help="stop each epoch after this many steps, for tiny runs (default: whole epoch)")
    if data and data_dir is not None:
        group.add_argument("--data-dir", type=input_dir, default=Path(os.environ.get("DATA_DIR") or data_dir),
                           help="folder holding downloaded data sets: $DATA_DIR when set, as for download_data.py "
                                "and the jobs (default: %(default)s)")
    if data and workers:
        default = max(min_workers, default_num_workers()) if num_workers is None else num_workers
        source = "" if num_workers is not None else "; from SLURM_CPUS_PER_TASK when set" + (
            f", at least {min_workers}" if min_workers else "")
        group.add_argument("--num-workers", type=worker_count, default=default,
                           help=f"DataLoader worker processes, at most {WORKERS_PER_CPU} per CPU{source} "
                                "(default: %(default)s)")
    return parser


class _FormerName(argparse.Action):
    """A flag's former name: sets the same value, and says once (rank 0) what the flag is called now."""

    def __init__(self, option_strings: list[str], dest: str, current: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.current = current

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if first_rank():
            print(f"note: {option_string} is now {self.current}; the old name still works", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_former_names(parser: argparse.ArgumentParser | argparse._ArgumentGroup, current: argparse.Action,
                     *former: str) -> argparse.Action:
    """Accept ``former`` spellings of the flag ``current`` (what ``add_argument`` returned), hidden from
    ``--help``: commands typed from older material keep working and learn the new name in one line."""
    for name in former:
        parser.add_argument(name, dest=current.dest, type=current.type, choices=current.choices,
                            nargs=current.nargs, metavar=current.metavar, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, action=_FormerName, current=max(current.option_strings, key=len))
    return current


def add_precision_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *former: str,
                      choices: tuple[str, ...] = ("fp32", "bf16", "fp16"), default: str = "fp32",
                      help: str = "fp32, or autocast to bf16 or fp16 with the matching gradient scaler "
                                  "(common.precision) (default: %(default)s)") -> argparse.Action:
    """``--precision``: what a training script computes in, the one name every script uses for it."""
    return add_former_names(parser, parser.add_argument("--precision", choices=choices, default=default, help=help),
                            *former)


def add_collective_timeout_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                               default: float | None = None) -> None:
    """``--collective-timeout SECONDS``: how long a collective may wait for its peers before the process
    group raises an error (Gloo's "Timed out waiting ... ms", NCCL's watchdog), applied once every rank
    is in the group. ``default`` is the script's own (Lab-06's, whose hangs are on purpose); ``None``
    keeps the group's usual timeout (``common.runtime.distributed.init_distributed``), so a hang is an
    error only after 10 minutes; a few seconds turn a hang in a tiny run into an error in bounded time."""
    usual = "the process group's own, 600 s" if default is None else f"{default:g}"
    parser.add_argument("--collective-timeout", type=positive_float, default=default, metavar="SECONDS",
                        help=f"seconds a collective waits for the other ranks before it fails (default: {usual})")


def add_timing_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, warmup: int, repeats: int,
                    what: str, former: tuple[str, ...] = ()) -> None:
    """How a measurement repeats (convention 8): ``--warmup`` untimed runs of ``what`` first, then
    ``--repeats`` timed ones whose median is reported (``common.measure.timing.time_function``'s
    ``warmup`` and ``repeats``). ``former``: names the count had before (``--iters``, ``--iterations``)."""
    parser.add_argument("--warmup", type=non_negative_int, default=warmup,
                        help=f"untimed {what} first, left out of the timing (default: %(default)s)")
    add_former_names(parser, parser.add_argument("--repeats", type=positive_int, default=repeats,
                                                 help=f"timed {what}; the median is reported (default: %(default)s)"),
                     *former)


def add_steps_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: int,
                  each: str = "") -> None:
    """``--steps N``: a run's total optimiser steps, for a script counted in steps rather than epochs (a cap on
    each epoch is ``--max-steps``, a benchmark's timed repeats ``--repeats``: docs/conventions.md). ``each``
    says what one step takes in this script."""
    parser.add_argument("--steps", type=positive_int, default=default,
                        help=f"optimiser steps{each} (default: %(default)s)")


def add_lr_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: float,
               optimizer: str = "SGD") -> None:
    """``--lr``: the learning rate of the script's ``optimizer`` (named in the help)."""
    parser.add_argument("--lr", type=positive_float, default=default,
                        help=f"{optimizer} learning rate (default: %(default)s)")


def add_log_interval_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: int = 10,
                         unit: str = "steps") -> None:
    """``--log-interval``: how many ``unit`` (steps, or the USC lab's batches) between two loss lines."""
    parser.add_argument("--log-interval", type=positive_int, default=default,
                        help=f"{unit} between loss lines (default: %(default)s)")


def apply_dry_run(args: argparse.Namespace, **at_most: int) -> argparse.Namespace:
    """``--dry-run`` means one epoch of at most two steps, and each of a script's own counts named in
    ``at_most`` (e.g. ``iterations=2, warmup=1``) at most that value. Without ``--dry-run``: unchanged."""
    if getattr(args, "dry_run", False):
        if hasattr(args, "epochs"):
            args.epochs = 1
            args.max_steps = min(args.max_steps or 2, 2)
        for name, most in at_most.items():
            value = getattr(args, name)
            setattr(args, name, most if value is None else min(value, most))
    return args


def command_flags(parser: argparse.ArgumentParser, values: Mapping[str, Any]) -> list[str]:
    """``values`` (destination -> value) as the command line that ``parser`` parses back into them.

    For a script that runs another as a process (as a student would): its flags are written from the
    target's own parser, so a renamed or removed flag is an error here, not a failed run later. An
    on/off flag appears when its value is true (``--no-X`` for a false ``BooleanOptionalAction``); a
    value of ``None`` leaves the flag out (its default applies).
    """
    actions = {action.dest: action for action in parser._actions  # a flag's current name, not a former one
               if action.option_strings and not isinstance(action, _FormerName)}
    argv: list[str] = []
    for dest, value in values.items():
        action = actions.get(dest)
        if action is None:
            raise ValueError(f"{parser.prog} has no flag for {dest!r}")
        flag = max(action.option_strings, key=len)  # the long form, as a student would type it
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if bool(value) != bool(action.default):
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def flags_given(parser: argparse.ArgumentParser, argv: Sequence[str], dests: Iterable[str]) -> dict[str, str]:
    """Which of ``dests`` the command line ``argv`` sets, in any spelling ``parser`` takes (``--seed 3``,
    ``--seed=3``, a prefix, a former name): {destination: its long flag}. For a script that passes flags after
    ``--`` to another and sets some of them itself. Flags ``parser`` does not know are left to its own check."""
    wanted = set(dests)
    names = {action.dest: max(action.option_strings, key=len) for action in parser._actions
             if action.dest in wanted and action.option_strings and not isinstance(action, _FormerName)}
    unset = object()  # a default no value can equal: what argv sets shows
    given, _ = parser.parse_known_args(list(argv), argparse.Namespace(**dict.fromkeys(names, unset)))
    return {dest: flag for dest, flag in names.items() if getattr(given, dest) is not unset}


def config_dict(args: argparse.Namespace, **derived: Any) -> dict[str, Any]:
    """The full configuration of a run for its record: every flag plus derived values."""
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    config.update(derived)
    return config


#: How Lab-02's batches are made (``common.data.pipelines.make_loader``), from the LANTA chapter's to the fastest.
PIPELINES = ("pil", "tensor", "device")
#: The MNIST-shaped data sets the pipelines read as uint8 images (``common.data.pipelines.load_uint8``).
DATASETS = ("digits", "mnist", "synthetic")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """``--dataset`` and ``--synthetic-size``: what ``common.data.pipelines.load_uint8`` reads, the same
    flags in every script."""
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits is bundled (offline); mnist needs --data-dir (default: %(default)s)")
    parser.add_argument("--synthetic-size", type=positive_int, default=60_000,
                        help="training images of --dataset synthetic, MNIST's count by default (default: %(default)s)")


#: Every precision Lab-03's benchmark knows, in the order its tables show them, with what it means.
#: (The ``--precision`` choices of the training scripts are another list: :data:`common.precision.TRAINING`.)
BENCHMARK_PRECISIONS: dict[str, str] = {
    "fp64": "float64 weights and inputs (model.double()): the SJTU page's 'double'",
    "fp32": "float32 with TF32 off: true IEEE single precision, the SJTU page's 'float' (PyTorch 1.6 had no TF32)",
    "tf32": "float32 storage, convolutions and matmuls on TF32 tensor cores (10-bit mantissa); "
            "PyTorch's default for cuDNN convolutions on Ampere and newer",
    "half": "the model cast to float16 (model.half()) but BatchNorm kept float32, no loss scaling: "
            "the SJTU page's 'half'",
    "amp-fp16": "float32 weights, autocast to float16 for convolutions and matmuls, GradScaler against underflow",
    "amp-bf16": "float32 weights, autocast to bfloat16 (float32's exponent range, so no scaler)",
}
#: What Lab-03 times: a training step (forward, backward, optimiser) or a forward pass alone.
BENCHMARK_MODES = ("train", "inference")
