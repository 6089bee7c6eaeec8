"""Shared helpers for every lab and chapter script.

Importing ``common`` first checks the installed PyTorch and torchvision against what this code
needs (the same minimums as ``pyproject.toml``). A cluster module with an older PyTorch (the SJTU page
names ``pytorch/1.6.0``) would otherwise fail somewhere in the middle of a run with a traceback
about a missing function; here it is one line, ``error: torch 1.6.0 found, 2.4 or newer needed``,
and exit status 2. Every script imports ``common`` before anything that an old PyTorch lacks.
The check reads versions only; it imports neither torch nor torchvision.
"""

from __future__ import annotations

import re
import sys

#: The oldest releases this code runs on; ``tests/test_gpu_paths.py`` keeps them equal to pyproject.toml's.
MINIMUM_VERSIONS = {"torch": (2, 4), "torchvision": (0, 19)}


def _release(version: str) -> tuple[int, ...]:
    """``"2.4.0a0+git3bcc"`` -> ``(2, 4, 0)``: the numeric release, local and pre-release tags ignored."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def installed_version(package: str) -> str | None:
    """The version of ``package`` this process uses (the imported module's when it is imported)."""
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        from importlib.metadata import PackageNotFoundError, version as metadata_version

        return metadata_version(package)
    except PackageNotFoundError:
        return None


def version_problem() -> str | None:
    """``"torch 1.6.0 found, 2.4 or newer needed"`` for the first package that is too old, else ``None``."""
    for package, minimum in MINIMUM_VERSIONS.items():
        found = installed_version(package)
        if found is not None and _release(found) < minimum:
            needed = ".".join(map(str, minimum))
            return f"{package} {found} found, {needed} or newer needed"
    return None


_problem = version_problem()
if _problem is not None:
    print(f"error: {_problem}: load a newer PyTorch module, or create the course environment "
          "(bash scripts/bootstrap.sh, or environments/ml-gpu.yaml)", file=sys.stderr, flush=True)
    raise SystemExit(2)
