"""ruff's pyflakes rules pass on every Python file of the repository (pyproject.toml, ``[tool.ruff.lint]``).

Much of the course runs only where a GPU is: a name that is not defined on such a path (a function moved
to another module, its import forgotten) fails there at run time, on the first GPU a student gets, and
no CPU run goes through it. Read statically, the same mistake fails here. ruff comes from the dev
dependencies (``uv sync`` installs it); it reads the files git tracks or would add (``.gitignore`` is
respected), in well under a second.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def ruff(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), "check", "--config", str(REPO_ROOT / "pyproject.toml"), "--no-cache",
                           "--output-format", "concise", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_no_python_file_has_an_undefined_or_unused_name():
    result = ruff(".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_name_undefined_on_a_gpu_only_path_is_found_without_a_gpu(tmp_path):
    # As envcheck.py had it: a helper called on the CUDA branch only, its import gone in a move.
    (tmp_path / "gpu_only.py").write_text(
        "import torch\n\n\n"
        "def describe(index: int) -> dict:\n"
        "    if torch.cuda.is_available():\n"
        "        props = torch.cuda.get_device_properties(index)\n"
        "        return {'bf16': gpu_support('bf16', (props.major, props.minor))}\n"
        "    return {}\n")
    result = ruff("gpu_only.py", cwd=tmp_path)
    assert result.returncode == 1 and "F821 Undefined name `gpu_support`" in result.stdout, result.stdout
