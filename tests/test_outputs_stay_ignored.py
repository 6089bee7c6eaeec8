"""What the course's commands write lands where git ignores it: ``git status`` stays clean.

Rerunning every README command would cost minutes, so the places are checked instead: every
default output location of every script (read from its parser, or from its ``--help`` where the
default is worked out at run time), every output a README command names (a checkpoint folder, a
profile, a report), each resolved from the repository root and from the README's own folder, both
ways people type them, and asked of ``git check-ignore``. The report's command line, which places a
bare file name beside the records, runs for real from a lab folder.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from common.errors import run_main as run_cli
from common.report import cli as report_cli
from common.results import make_record, write_record
from helpers import REPO, load_script

#: Flags that name a place a run writes, and kernprof's ``-o`` (the profile).
WRITE_FLAGS = ("--results-dir", "--checkpoint", "--checkpoint-dir", "--trace", "--folder", "--profile-dir",
               "--output-report", "--csv", "-o")


def scripts_with_parsers() -> list[str]:
    paths = [path for folder in ("chapters", "labs") for path in sorted((REPO / folder).glob("*/*.py"))]
    paths += sorted((REPO / "scripts").glob("*.py")) + sorted((REPO / "bench").glob("*.py"))
    return [str(p.relative_to(REPO)) for p in paths if "def build_parser" in p.read_text()] + ["common/report/cli.py"]


def unignored(paths: list[Path]) -> list[str]:
    """The paths (relative to the repository root) that git would show as new files."""
    names = [str(path) for path in paths]
    done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO, input="\n".join(names),
                          capture_output=True, text=True, timeout=30)
    ignored = set(done.stdout.splitlines())
    return [name for name in names if name not in ignored]


def where_typed(script: str) -> list[Path]:
    """The folders a student runs a script from: the repository root and the script's own folder."""
    return [Path("."), Path(script).parent]


def test_every_default_output_location_of_every_script_is_ignored_by_git():
    places: list[Path] = []
    for script in scripts_with_parsers():
        parser = load_script(script).build_parser()
        try:
            defaults = vars(parser.parse_args([]))
        except SystemExit:  # a script that needs an argument (download_data.py's DATASET) writes nothing by default
            continue
        results_dir = defaults.get("results_dir") or Path("results")
        for action in parser._actions:
            if not set(action.option_strings) & set(WRITE_FLAGS):
                continue
            value = defaults.get(action.dest)
            if value is None:  # worked out at run time: its --help says where
                said = re.search(r"default: ([^)]*)\)?\s*$", action.help or "")
                assert said, f"{script} {action.option_strings}: --help gives no default"
                where = said.group(1)
                if not where.startswith(("RESULTS_DIR", "the report's path", "standard output", "none")):
                    pytest.fail(f"{script} {action.option_strings[-1]} defaults to {where!r}, outside RESULTS_DIR")
                value = results_dir / "x" if where.startswith("RESULTS_DIR") else None
            if value is not None:
                places += [folder / Path(value) / "file.json" for folder in where_typed(script)]
    assert len(places) >= 40
    assert unignored(places) == []


def readme_outputs(readme: Path) -> list[tuple[str, Path]]:
    """(command, output) for every write flag a README's bash commands give a relative path."""
    found = []
    text = readme.read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    blocks += re.findall(r"(?<!`)`((?:python|bash|torchrun) [^`]*)`", text)  # commands in the prose
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(command, comments=True)
            except ValueError:
                continue
            if any(word.endswith("render_sbatch.py") for word in words):
                continue  # a job script rendered for your site is yours to keep and submit, not litter
            results_dir = Path("results")
            for flag, value in zip(words, words[1:]):
                if flag == "--results-dir":
                    results_dir = Path(value)
            report = any(word.endswith("compare_results.py") for word in words)  # it reads --results-dir
            if report and "--output-report" not in words and not re.fullmatch(r"[A-Z_]+", str(results_dir)):
                found.append((command.strip(), results_dir / "comparison_report.html"))  # the report's default
            for flag, value in zip(words, words[1:]):
                if flag not in WRITE_FLAGS or value.startswith(("/", "~", "$", "<")) or "$" in value:
                    continue
                if re.fullmatch(r"[A-Z_]+", value) or (report and flag == "--results-dir"):  # DIR: yours to name
                    continue
                path = Path(value)
                if flag in ("--output-report", "--csv"):  # what the report's command line makes of it
                    path = report_cli.beside_records(path, results_dir)
                found.append((command.strip(), path))
    return found


def test_every_output_a_readme_command_names_is_ignored_by_git():
    """Checkpoints, profiles, traces and reports named in README commands, from where they are typed."""
    readmes = sorted(REPO.glob("chapters/*/README.md")) + sorted(REPO.glob("labs/*/README.md"))
    named = [(readme, command, path) for readme in readmes for command, path in readme_outputs(readme)]
    assert {"--checkpoint-dir", "-o", "--output-report"} <= {w for _, c, _ in named for w in c.split()}
    litter = []
    for readme, command, path in named:
        folders = [Path("."), readme.parent.relative_to(REPO)]
        for place in unignored([folder / path / "file" for folder in folders]):
            litter.append(f"{readme.relative_to(REPO)}: {command!r} writes {place}")
    assert litter == []


def lab_records(folder: Path) -> None:
    for lab, method in (("lab01", "baseline"), ("lab01", "ddp"), ("lab04", "fsdp")):
        write_record(make_record(lab=lab, script=f"labs/{lab}/x.py", method=method, config={"model": "m"},
                                 metrics={"samples_per_s": 10.0, "world_size": 1}, provenance={"hostname": "h"}),
                     folder)


def test_the_handouts_report_command_from_a_lab_folder_writes_beside_the_records(tmp_path, monkeypatch, capsys):
    """Lab-01's handout names its report with a bare file name: it lands in the results folder, not in
    the folder the command was typed in; runs of several labs are named, and --lab keeps one."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (tmp_path / ".gitignore").write_text((REPO / ".gitignore").read_text())  # a checkout with the course's rules
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", ".gitignore"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "course"], cwd=tmp_path, check=True)
    lab = tmp_path / "labs" / "lab01_dp_vs_ddp"
    lab_records(lab / "results")  # steps 1-3 ran
    monkeypatch.chdir(lab)
    argv = ["--results-dir", "./results", "--generate-plots", "--output-report", "comparison_report.html",
            "--no-plots"]
    assert report_cli.main(argv) == 0
    out = capsys.readouterr().out
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout
    assert status == ""
    assert sorted(p.name for p in lab.iterdir()) == ["results"]
    assert (lab / "results" / "comparison_report.html").is_file()
    assert (lab / "results" / "comparison_report.csv").is_file()
    assert ("note: runs of 2 labs in one report (lab01, lab04); --lab LAB, one of them, writes a report of that lab "
            "alone: results/LAB_comparison_report.html") in out

    assert report_cli.main(["--results-dir", "results", "--lab", "lab04", "--no-plots"]) == 0
    assert "note:" not in capsys.readouterr().out
    rows = (lab / "results" / "lab04_comparison_report.csv").read_text().splitlines()
    assert len(rows) == 2 and ",lab04," in rows[1]


def test_a_lab_without_records_is_one_error_line_and_writes_nothing(tmp_path, capsys):
    lab_records(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as stopped:
        run_cli(report_cli.main, ["--results-dir", str(tmp_path), "--lab", "lab09", "--no-plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and err == [
        f"error: no result records of lab09 in {tmp_path} (its records are of: lab01, lab04)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
