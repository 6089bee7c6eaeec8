"""Shared helpers for every lab and chapter script.

Importing ``common`` first checks the installed PyTorch and torchvision against the course's floor
(the same minimums as ``pyproject.toml``): the oldest release on which every lesson's shortest run
works, proven in CI by ``bash scripts/torch_floor.sh``. A cluster module with an older PyTorch (the
SJTU page names ``pytorch/1.6.0``; a 2.7 lacks a working 1F1B pipeline over Gloo) would otherwise fail
somewhere in the middle of a run, after the queue; here it is one line, ``error: torch 2.7.1 found,
2.8 or newer needed: ...``, and exit status 2. Every script imports ``common`` before anything that an
old PyTorch lacks. The check reads versions only; it imports neither torch nor torchvision. Vendor
builds read as their release: NGC's ``2.8.0a0+5228986`` is a 2.8. What differs between the releases
above the floor is ``common.runtime.compat``'s business.
"""

from __future__ import annotations

import re
import sys

#: The oldest releases this code runs on (torchvision 0.23 is torch 2.8's); ``tests/test_gpu_paths.py`` keeps
#: them equal to pyproject.toml's, ``scripts/torch_floor.sh`` runs every lesson with them.
MINIMUM_VERSIONS = {"torch": (2, 8), "torchvision": (0, 23)}


def _release(version: str) -> tuple[int, ...]:
    """``"2.8.0a0+git3bcc"`` -> ``(2, 8, 0)``: the numeric release, local and pre-release tags ignored
    (NGC's images ship such pre-release builds of a release, and call them so)."""
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
    """``"torch 2.7.1 found, 2.8 or newer needed"`` for the first package that is too old, else ``None``."""
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
