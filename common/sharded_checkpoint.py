"""Checkpoints of sharded models with PyTorch Distributed Checkpoint (DCP), synchronous or asynchronous.

``torch.save`` from rank 0 needs the whole model on rank 0; under FSDP2 no rank has it. With DCP
every rank writes its own shards into one folder, and a ``.metadata`` file records which piece of
which tensor is where. Loading reads the metadata and fetches, for each tensor this rank holds,
the pieces that overlap its shard, whatever the number of ranks that wrote them: a run saved on
4 ranks resumes on 2 or 1 (DCP *reshards*). DDP's replicated tensors are written once, by one
rank, so the same folder format serves both strategies (a DDP checkpoint loads into FSDP2 and back).

    checkpointer = DistributedCheckpointer("checkpoints/run1", async_save=True)
    checkpointer.save(progress, {"model": model, "optimizer": optimizer}, step_tag="epoch1")  # every rank
    ...
    progress = checkpointer.load({"model": model, "optimizer": optimizer})  # None: nothing saved yet
    checkpointer.close()                                                   # waits for a save in flight

Layout: ``DIR/ckpt-000003-epoch1/`` (a sequence number, then the tag), complete once DCP has
written its ``.metadata`` (the last file, renamed into place), so a job killed mid-save leaves a
folder that :meth:`load` ignores. The newest ``keep`` complete folders are kept.

Asynchronous saving (``dcp.async_save``): the call copies this rank's shards into CPU memory
(*staging*) and returns; a background thread writes them while training continues. The thread's
collectives run on a process group of their own (Gloo) so they never interleave with the
training's. The next save (and :meth:`close`) first waits for the one in flight. ``timings``
records, per save, how long the training loop stood still (``stall_s``) and, for asynchronous
saves, when the files were complete (``complete_s``, from the start of the save).
"""

from __future__ import annotations

import io
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.errors import UserError

__all__ = ["DistributedCheckpointer", "complete_checkpoints"]

_FOLDER = re.compile(r"^ckpt-(\d{6})-(.+)$")
#: The keys under which tracked objects other than the model and the optimizer are saved (as bytes).
_EXTRA = ("scheduler", "scaler")


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoint folders in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _FOLDER.match(path.name)
        if match and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


class _Pickled:
    """Any picklable value as one item of a DCP checkpoint (DCP's ``Stateful`` protocol).

    DCP writes a ``BytesIO`` as it is and unpickles it again on load, handing the result to
    :meth:`load_state_dict`; tensors inside (random generator states) are not sharded or merged.
    """

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.value, buffer)
        buffer.seek(0)
        return {"pickled": buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        value = state["pickled"]
        if isinstance(value, io.BytesIO):
            value.seek(0)
            value = torch.load(value, weights_only=False)
        self.value = value


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class DistributedCheckpointer:
    """Save and load a run's state with DCP; every method is called on every rank."""

    def __init__(self, directory: str | Path, *, async_save: bool = False, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.async_save = async_save
        self.keep = max(keep, 2 if async_save else 1)  # the newest may still be in flight
        self.timings: list[dict[str, Any]] = []
        self._pending: Any = None  # the Future of the save in flight
        # Background collectives need a group of their own, and a CPU one: Gloo.
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    # ---- saving -------------------------------------------------------------------------------

    def save(self, state: dict[str, Any], tracked: dict[str, Any], *, step_tag: str) -> Path:
        """Write ``tracked`` (model, optimizer; scheduler and scaler when present) and ``state``.

        ``state`` is this rank's progress (epoch, step, losses, random generator states ...); every
        rank's copy is kept, and :meth:`load` returns a rank its own, or rank 0's when the resumed
        run has more ranks than the saved one.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        began = time.perf_counter()
        self.wait()  # one save in flight at a time
        # Every rank's progress, and rank 0's folder number (a rank listing the folder while
        # another already creates the new one could count one more).
        gathered = _gather((state, self._next_number()))
        path = self.directory / f"ckpt-{gathered[0][1]:06d}-{_safe(step_tag)}"
        model_state, optimizer_state = get_state_dict(tracked["model"], tracked["optimizer"])
        extra = {key: tracked[key].state_dict() for key in _EXTRA if tracked.get(key) is not None}
        progress = {"per_rank": [rank_state for rank_state, _ in gathered], "extra": extra}
        payload = {"model": model_state, "optimizer": optimizer_state, "progress": _Pickled(progress)}
        timing: dict[str, Any] = {"tag": step_tag, "mode": "async" if self.async_save else "sync"}
        self.timings.append(timing)
        if self.async_save:
            future = dcp.async_save(payload, checkpoint_id=str(path), process_group=self._group)
            future.add_done_callback(lambda _: timing.__setitem__("complete_s", time.perf_counter() - began))
            self._pending = (future, path)
        else:
            dcp.save(payload, checkpoint_id=str(path))
            timing["complete_s"] = time.perf_counter() - began
            self._saved(path)
        timing["stall_s"] = time.perf_counter() - began
        return path

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete on every rank."""
        if self._pending is None:
            return
        future, path = self._pending
        self._pending = None
        future.result()
        self._saved(path)

    def _saved(self, path: Path) -> None:
        """After a complete save: rank 0 removes the oldest folders beyond ``keep``."""
        if dist.is_initialized():
            dist.barrier(group=self._group)  # every rank has finished writing before anything is removed
        if _rank() == 0:
            for old in complete_checkpoints(self.directory)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def _next_number(self) -> int:
        numbers = [int(m.group(1)) for p in (self.directory.iterdir() if self.directory.is_dir() else ())
                   if (m := _FOLDER.match(p.name))]
        return max(numbers, default=0) + 1

    # ---- loading ------------------------------------------------------------------------------

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.directory)
        return found[-1] if found else None

    def load(self, tracked: dict[str, Any]) -> dict[str, Any] | None:
        """Load the newest complete checkpoint into ``tracked``; return this rank's ``state`` (or ``None``).

        The saved tensors' shapes are checked against the model first, so a folder written for
        another model is one clear error instead of a failure deep inside DCP.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = self.latest()
        if path is None:
            return None
        model, optimizer = tracked["model"], tracked["optimizer"]
        model_state, optimizer_state = get_state_dict(model, optimizer)
        check_same_model(path, model_state)
        payload = {"model": model_state, "optimizer": optimizer_state, "progress": _Pickled()}
        dcp.load(payload, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optimizer"])
        progress = payload["progress"].value
        for key, value in progress["extra"].items():
            if tracked.get(key) is not None:
                tracked[key].load_state_dict(value)
        per_rank = progress["per_rank"]
        state = per_rank[_rank()] if _rank() < len(per_rank) else per_rank[0]
        return {**state, "checkpoint_path": str(path), "saved_world_size": len(per_rank)}

    def close(self) -> None:
        """Wait for a save in flight, then release the background process group."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


def check_same_model(path: Path, model_state: dict[str, Any]) -> None:
    """Refuse, with one line, a checkpoint whose model tensors differ in name or shape from ``model_state``."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = {key[len("model."):]: value for key, value in FileSystemReader(str(path)).read_metadata()
             .state_dict_metadata.items() if key.startswith("model.")}
    missing = sorted(set(model_state) - set(saved))
    unexpected = sorted(set(saved) - set(model_state))
    if missing or unexpected:
        what = (f"this model has {missing[0]} and {len(missing) - 1} more tensor(s) the checkpoint lacks" if missing
                else f"the checkpoint has {unexpected[0]} and {len(unexpected) - 1} more tensor(s) this model lacks")
        raise UserError(f"{path} was written for another model: {what}; resume with the same model flags, "
                        "or use another checkpoint folder")
    for key, tensor in model_state.items():
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(tensor.shape):
            raise UserError(f"{path} was written for another model: {key} is {list(size)} there and "
                            f"{list(tensor.shape)} here; resume with the same model flags, or use another "
                            "checkpoint folder")


def _safe(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(tag)) or "step"
