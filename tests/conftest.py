"""Test-suite wiring: make ``helpers`` and ``common`` importable from every test folder, skip GPU tests on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu`` tests skip, with the reason, where PyTorch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False on this machine")
    for item in gpu_items:
        item.add_marker(skip)
