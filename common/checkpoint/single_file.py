"""Checkpoints written atomically, with the random state that makes a resumed run repeat an unbroken one.

A job killed while writing ``checkpoint.pt`` must not leave a truncated file that the requeued job
then fails to load: :func:`save_checkpoint` writes through :func:`common.atomic.atomic_path`
(a temporary file beside it, fsync, rename over the old one).

The stop signal and the resume policy that use them are :mod:`common.train.preemption`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_path
from common.errors import UserError


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return Path(path)


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save_checkpoint`, or ``None`` when there is none."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as error:  # truncated, another file, a pickle of something else: all one answer
        raise unreadable_checkpoint(path, error) from error
    if not isinstance(state, dict):
        raise unreadable_checkpoint(path, f"it holds a {type(state).__name__}, not a checkpoint's dict")
    return state


def unreadable_checkpoint(path: str | os.PathLike[str], why: object) -> UserError:
    """The one line for a checkpoint that cannot be read: which file, why, and what to do."""
    lines = [line.strip() for line in str(why).splitlines() if line.strip()]
    reason = lines[-1][:200] if lines else type(why).__name__  # DCP's errors end in the cause after a traceback
    return UserError(f"{path} cannot be read as a checkpoint ({reason}): it may be truncated or not a checkpoint "
                     "of this script; move it away (or give --checkpoint another path) and run without --resume "
                     "to start fresh")


#: What a resumed run may not change but no flag sets, by its key; every other key is a flag's (``--batch-size``).
SETTING_NAMES = {"world_size": "the number of ranks", "shards": "the shard set"}


def check_same_settings(state: dict[str, Any], settings: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Refuse to resume from a checkpoint written with other ``settings`` (batch size, data set ...):
    the resumed run would silently train something else. ``state["config"]`` is what was saved."""
    saved = state.get("config", {})
    differ = [f"{SETTING_NAMES.get(key, '--' + key.replace('_', '-'))} {saved[key]!r} there, {value!r} here"
              for key, value in settings.items() if key in saved and saved[key] != value]
    if differ:
        raise UserError(f"{path} was written with other settings ({'; '.join(differ)}); "
                        "resume with the same settings or start fresh without --resume")


def check_steps_left(step: int, steps: int, path: str | os.PathLike[str]) -> None:
    """Refuse to resume a run counted in steps (``--steps``) from a checkpoint already at ``step >= steps``: it
    would train nothing and record no loss."""
    if step >= steps:
        raise UserError(f"{path} is at step {step}: a run of --steps {steps} has nothing left to train; give more "
                        "--steps, or start afresh without --resume")


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every random number generator a training step draws from (dropout, shuffling, init).

    On a GPU only *this process's* device's generator is kept: each rank saves its own, and a rank
    that sees fewer GPUs than the saving rank did can still restore it.
    """
    import random

    import numpy as np

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Undo :func:`capture_rng_state`, so a resumed run draws the same numbers as an unbroken one."""
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
