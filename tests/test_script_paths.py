"""Every script's path flags: a file where a folder belongs, a folder where a file belongs, or a place
that cannot be written is one ``error:`` line and exit status 2, with nothing written.

Each script's own parser is built (``build_parser()``, as its ``main`` builds it) and given each bad
path in turn, in an empty folder that must stay empty. Which check a flag gets follows from its
type: the path types of ``common.cli`` say folder or file, read or written. A path flag typed plain
``pathlib.Path`` says neither, so it fails here: that is how a new script's flag joins the check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from common import cli
from helpers import REPO, load_script

FOLDERS = {cli.input_dir, cli.output_dir}
FILES = {cli.input_file, cli.output_file, cli.output_file_or_name}
WRITTEN = {cli.output_dir, cli.output_file, cli.output_file_or_name}
PATH_TYPES = FOLDERS | FILES | {cli.input_path}
SCRIPTS = sorted(str(path.relative_to(REPO)) for pattern in ("chapters/*/*.py", "labs/*/*.py", "scripts/*.py",
                                                             "bench/*.py")
                 for path in REPO.glob(pattern) if not path.name.endswith("_shared.py"))


def script_parser_of(relpath: str) -> argparse.ArgumentParser:
    """The parser ``main`` parses with: the script's ``build_parser()``, or that of the module its
    ``main`` comes from (the report's command line, which two scripts run under their own names)."""
    module = load_script(relpath)
    build = getattr(module, "build_parser", None) or getattr(sys.modules[module.main.__module__], "build_parser", None)
    assert build is not None, f"{relpath}: no build_parser() (main builds its parser there, so tests can read it)"
    return build()


def parsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """``(argv prefix, parser)`` for the parser and each of its sub-commands."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*prefix, name))


def path_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if action.type in PATH_TYPES]


def looks_like_a_path(action: argparse.Action) -> bool:
    """A flag that takes a value and is typed plain ``Path``, defaults to a ``Path``, or is named like one."""
    if action.nargs == 0 or isinstance(action, argparse._SubParsersAction) or action.type in PATH_TYPES:
        return False
    return (action.type is Path or isinstance(action.default, Path)
            or action.dest.endswith(("_dir", "_file", "_path", "_folder")))


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create anything in: a read-only one, or for root (whom permission
    bits do not stop) ``/proc``, which takes no new files."""
    candidates = [tmp_path / "read-only", Path("/proc")]
    candidates[0].mkdir()
    candidates[0].chmod(0o555)
    for folder in candidates:
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError:
            return folder
    pytest.skip("no folder on this machine refuses a new file to this process")


def valid_argv(prefix: tuple[str, ...], parser: argparse.ArgumentParser, skip: argparse.Action,
               good: dict) -> list[str]:
    """The sub-command and a good value for every required argument but ``skip``."""
    argv = list(prefix)
    for action in parser._actions:
        if action is skip or action.nargs == argparse.REMAINDER or not (
                action.required or (not action.option_strings and action.nargs in (None, "+"))):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        value = action.choices[0] if isinstance(action.choices, (list, tuple)) else \
            sorted(action.choices)[0] if action.choices else good[action.type]
        argv += [*action.option_strings[:1], str(value)]
    return argv


def bad_paths(kind, root: Path, unwritable: Path) -> dict[str, Path | str]:
    """What each kind of path flag must refuse."""
    cases: dict[str, Path | str] = {"an empty path (a variable that was not set)": ""}  # Path("") is the current folder
    if kind in FOLDERS:
        cases["a file where a folder belongs"] = root / "a-file"
    if kind in FILES:
        cases["a folder where a file belongs"] = root / "a-folder"
    if kind in WRITTEN and kind in FILES:  # Path("new/") is "new": it would write a file where a folder was meant
        cases["a new folder where a file belongs"] = f"{root / 'new-folder'}/"
    if kind in WRITTEN:
        cases["a place that cannot be written"] = unwritable / ("new-folder" if kind in FOLDERS else "new.json")
    return cases


def test_every_script_has_a_parser_and_every_path_flag_says_folder_or_file():
    untyped, counted = {}, 0
    for relpath in SCRIPTS:
        for prefix, parser in parsers(script_parser_of(relpath)):
            counted += len(path_actions(parser))
            odd = ["/".join(a.option_strings) or a.dest for a in parser._actions if looks_like_a_path(a)]
            if odd:
                untyped[" ".join((relpath, *prefix))] = odd
    assert not untyped, f"path flags without a path type of common.cli: {untyped}"
    assert len(SCRIPTS) >= 35 and counted >= 60, (len(SCRIPTS), counted)


def test_every_on_off_flag_says_its_default_as_on_or_off():
    """A switch's help says "(default: off)" or "(default: on)", as every other flag says its value; argparse's
    %(default)s would print Python's False or True (28 scripts' --dry-run did)."""
    said = {}
    for relpath in SCRIPTS:
        for prefix, parser in parsers(script_parser_of(relpath)):
            for action in parser._actions:
                if action.nargs == 0 and action.help not in (None, argparse.SUPPRESS) and action.dest != "help":
                    text = parser._get_formatter()._expand_help(action)
                    if re.search(r"\(default: (True|False)\)", text):
                        said.setdefault("/".join(action.option_strings), []).append(" ".join((relpath, *prefix)))
    assert not said, said


@pytest.mark.parametrize("relpath", SCRIPTS)
def test_a_wrong_path_is_one_error_line_and_writes_nothing(relpath, tmp_path, monkeypatch, capsys):
    root = tmp_path / "work"
    root.mkdir()
    (root / "a-file").write_text("not a folder\n")
    (root / "a-folder").mkdir()
    (root / "input.txt").write_text("read me\n")
    unwritable = unwritable_folder(tmp_path)
    good = {cli.input_dir: root, cli.output_dir: root, cli.input_file: root / "input.txt",
            cli.output_file: root / "out.json", cli.output_file_or_name: root / "out.html",
            cli.input_path: root / "input.txt"}
    monkeypatch.chdir(root)  # defaults such as --results-dir results are relative to it
    before = sorted(os.walk(root))
    refused = 0
    for prefix, parser in parsers(script_parser_of(relpath)):
        for action in path_actions(parser):
            for case, bad in bad_paths(action.type, root, unwritable).items():
                argv = valid_argv(prefix, parser, action, good) + [*action.option_strings[:1], str(bad)]
                with pytest.raises(SystemExit) as exit_:
                    parser.parse_args(argv)
                err = capsys.readouterr().err
                where = f"{relpath} {' '.join(argv)} ({case})"
                assert exit_.value.code == 2, where
                assert len(err.splitlines()) == 1 and err.startswith("error: ") and str(bad) in err, f"{where}: {err}"
                refused += 1
    assert sorted(os.walk(root)) == before, f"{relpath} wrote something"
    if refused == 0:
        pytest.skip(f"{relpath} takes no path")


#: Scripts that do not go through a data set epoch by epoch, or read no data set at all, and the common
#: flags they therefore do not offer (an offered flag that changes nothing reads as if it had worked).
NOT_OFFERED = {
    "chapters/ch16_gpu_distributed/profiling.py": ("--epochs", "--max-steps", "--data-dir", "--num-workers"),
    "chapters/ch16_gpu_distributed/benchmark_cpu_vs_gpu.py": ("--epochs", "--max-steps", "--data-dir", "--num-workers"),
    "chapters/ch16_gpu_distributed/efficient_loading.py": ("--epochs", "--max-steps", "--data-dir"),  # digits ships
    "labs/lab02_profiling/profile_trace.py": ("--epochs", "--max-steps"),
    "labs/lab04_sharded_training/01_memory_budget.py": ("--epochs", "--max-steps", "--data-dir", "--num-workers"),
    "labs/lab04_sharded_training/03_largest_model.py": ("--epochs", "--max-steps", "--data-dir", "--num-workers"),
}


@pytest.mark.parametrize("script", sorted(NOT_OFFERED))
def test_a_flag_that_would_change_nothing_is_refused(script, capsys):
    parser = script_parser_of(script)
    for flag in NOT_OFFERED[script]:
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args([flag, "1"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"unrecognized arguments: {flag} 1" in err, (flag, err)
    assert parser.parse_args(["--batch-size", "4"]).batch_size == 4  # the flags it reads are still there


#: Values no count, size, rate or timeout of a script can take, by flag (every script that has the flag).
NONSENSE = {"--batch-size": ["0", "-3", "x"], "--epochs": ["0", "-1"], "--max-steps": ["0"],
            "--num-workers": ["-1", "100000"],  # more than common.cli.WORKERS_PER_CPU per CPU: a thousand processes
            "--repeats": ["0"], "--warmup": ["-1"], "--steps": ["0"], "--lr": ["-1", "0", "nan", "inf"],
            "--seed": ["x", str(2**64)],
            "--image-size": ["0", "-5"], "--log-interval": ["0"], "--width": ["0"], "--layers": ["0"],
            "--heads": ["0"], "--context": ["0"], "--global-batch-size": ["0"], "--microbatches": ["0"],
            "--collective-timeout": ["0", "-1", "nan"], "--samples": ["0"], "--shard-size": ["0"],
            "--quality": ["0", "101"], "--budget": ["0", "-1"], "--warmup-steps": ["-1"], "--test-batch-size": ["0"],
            "--clip-grad-norm": ["-1"]}
#: Where a flag of that name means something else: Lab-02's sweep takes step names under --steps (now --stages).
OTHER_MEANING = {("labs/lab02_profiling/sweep.py", "--steps")}


def test_no_script_takes_a_nonsense_count_size_or_rate():
    accepted = []
    for script in SCRIPTS:
        for prefix, parser in parsers(script_parser_of(script)):
            flags = {flag for action in parser._actions for flag in action.option_strings}
            for flag in sorted(flags & set(NONSENSE) - {flag for where, flag in OTHER_MEANING if where == script}):
                for value in NONSENSE[flag]:
                    try:
                        with contextlib.redirect_stderr(io.StringIO()):
                            parser.parse_args([*prefix, flag, value])
                        accepted.append(f"{script} {' '.join(prefix)} {flag} {value}".replace("  ", " "))
                    except SystemExit as stopped:
                        assert stopped.code == 2, (script, flag, value)
    assert accepted == [], ("a count, size, rate or timeout takes one of common.cli's checked types "
                            "(positive_int, non_negative_int, positive_float, non_negative_float): "
                            f"these values were accepted: {accepted}")


#: Numbers any value of which means something: the rank an old launcher passes.
ANY_NUMBER = {"--local-rank", "--local_rank"}


def test_every_number_flag_takes_a_checked_type():
    """A new count, size, rate or timeout uses common.cli's checked types, not a plain int or float that takes -1 or
    nan (``01_sweep.py --task -1`` ran the sweep's last task, ``--weight-decay -1`` trained): NONSENSE above then needs
    no entry for the new flag to be checked."""
    plain = sorted({f"{script} {max(action.option_strings, key=len)}" for script in SCRIPTS
                    for _, parser in parsers(script_parser_of(script)) for action in parser._actions
                    if action.type in (int, float) and not set(action.option_strings) & ANY_NUMBER})
    assert plain == [], ("give these flags one of common.cli's checked types (positive_int, non_negative_int, "
                         f"positive_float, non_negative_float): {plain}")
