"""Checkpoints of sharded models with PyTorch Distributed Checkpoint (DCP), synchronous or asynchronous.

``torch.save`` from rank 0 needs the whole model on rank 0; under FSDP2 no rank has it. With DCP
every rank writes its own shards into one folder, and a ``.metadata`` file records which piece of
which tensor is where. Loading reads the metadata and fetches, for each tensor this rank holds,
the pieces that overlap its shard, whatever the number of ranks that wrote them: a run saved on
4 ranks resumes on 2 or 1 (DCP *reshards*). DDP's replicated tensors are written once, by one
rank, so the same folder format serves both strategies (a DDP checkpoint loads into FSDP2 and back).

:class:`DistributedCheckpointer` is a checkpointer for :class:`common.train.run.TrainingRun`::

    checkpointer = DistributedCheckpointer(args.checkpoint_dir, async_save=args.async_checkpoint)
    with TrainingRun(args, ..., distributed=True, checkpointer=checkpointer) as run:
        ...

(every method is called on every rank). Layout: ``DIR/ckpt-000003-epoch2-step0/`` (a sequence
number, then where the run stood), complete once DCP has written its ``.metadata`` (the last file,
renamed into place), so a job killed mid-save leaves a folder that is ignored. The newest ``keep``
complete folders are kept.

Asynchronous saving (``dcp.async_save``): the call copies this rank's shards into CPU memory
(*staging*) and returns; a background thread writes them while training continues. The thread's
collectives run on a process group of their own (Gloo), so they never interleave with the
training's. The next save, :meth:`~DistributedCheckpointer.wait` and
:meth:`~DistributedCheckpointer.close` wait for the one in flight. ``timings`` records, per save,
how long the training loop stood still (``stall_s``) and when the files were complete
(``complete_s``), both counted from the start of the save.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from common.checkpoint.single_file import unreadable_checkpoint
from common.errors import UserError

__all__ = ["DistributedCheckpointer", "complete_checkpoints", "check_same_model"]

# DCP wraps what went wrong on each rank in a CheckpointException, which derives from BaseException
# (not Exception), so ``except Exception`` does not catch it.
_LOAD_ERRORS = (Exception, CheckpointException)
_FOLDER = re.compile(r"^ckpt-(\d{6})-(.+)$")


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


@contextlib.contextmanager
def _one_process_quiet():
    """DCP without a process group (one process, as Lab-07's ``--mesh 1x1``) saves and loads as it should, but warns
    that it is "assuming" so at every call, even when told (``no_dist=True``): that one warning is left out here.
    DCP also wraps whatever one of its steps raised in ``CheckpointException`` (a ``BaseException``), Ctrl-C
    included: that is turned back into ``KeyboardInterrupt``, so Ctrl-C mid-save is 'interrupted', not a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", "torch.distributed is (disabled, )?unavailable or uninitialized",
                                    UserWarning)
        try:
            yield
        except CheckpointException as error:
            if any(isinstance(failure[0], KeyboardInterrupt) for failure in error.failures.values()):
                raise KeyboardInterrupt from error
            raise


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


class DistributedCheckpointer:
    """A :class:`common.train.preemption.Checkpointer` that writes with DCP from every rank (and reshards on load)."""

    flag = "--checkpoint-dir"
    reshards = True
    every_rank_writes = True

    def __init__(self, directory: str | Path, *, async_save: bool = False, keep: int = 2) -> None:
        self.path = Path(directory)
        self.async_save = async_save
        self.keep = max(keep, 2 if async_save else 1)  # the newest may still be in flight
        self.timings: list[dict[str, Any]] = []
        self._pending: tuple[Any, Path] | None = None  # the Future of the save in flight, and its folder
        self._group: Any = None                         # the background saves' own process group
        self._reading: Path | None = None               # the folder read() found, for restore()
        self._others: dict[str, Any] = {}               # and the state dicts of what is not model or optimizer

    # ---- saving -------------------------------------------------------------------------------

    def save(self, state: dict[str, Any], tracked: dict[str, Any]) -> None:
        """Write ``tracked`` (the model and optimizer as DCP shards, anything else pickled) and ``state``.

        ``state`` must be the same on every rank (``TrainingRun`` gathers every rank's random states
        into it); one copy is written.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        began = time.perf_counter()
        self.wait()  # one save in flight at a time
        folder = self.path / f"ckpt-{self._next_number():06d}-epoch{state.get('epoch')}-step{state.get('step')}"
        model_state, optimizer_state = get_state_dict(tracked["model"], tracked["optimizer"])
        others = {name: obj.state_dict() for name, obj in tracked.items() if name not in ("model", "optimizer")}
        payload = {"model": model_state, "optimizer": optimizer_state,
                   "progress": _Pickled({"state": state, "others": others, "tracked": sorted(tracked)})}
        timing: dict[str, Any] = {"folder": folder.name, "mode": "async" if self.async_save else "sync"}
        self.timings.append(timing)
        if self.async_save:
            if self._group is None:  # made on first use, by every rank (a collective)
                self._group = dist.new_group(backend="gloo")
            future = dcp.async_save(payload, checkpoint_id=str(folder), process_group=self._group)
            future.add_done_callback(lambda _: timing.__setitem__("complete_s", time.perf_counter() - began))
            self._pending = (future, folder)
        else:
            with _one_process_quiet():
                dcp.save(payload, checkpoint_id=str(folder))
            timing["complete_s"] = time.perf_counter() - began
            self._finished()
        timing["stall_s"] = time.perf_counter() - began

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete on every rank."""
        if self._pending is None:
            return
        future, _folder = self._pending
        self._pending = None
        future.result()
        self._finished()

    def _finished(self) -> None:
        """After a complete save: rank 0 removes the oldest folders beyond ``keep``."""
        if dist.is_initialized():
            dist.barrier(group=self._group)  # every rank has finished writing before anything is removed
        if not dist.is_initialized() or dist.get_rank() == 0:
            for old in complete_checkpoints(self.path)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def _next_number(self) -> int:
        """One more than the newest folder's number, as rank 0 sees it (one listing, then shared:
        a rank that listed while another already created the new folder would count one more)."""
        numbers = [int(m.group(1)) for p in (self.path.iterdir() if self.path.is_dir() else ())
                   if (m := _FOLDER.match(p.name))]
        chosen = [max(numbers, default=0) + 1]
        if dist.is_initialized():
            dist.broadcast_object_list(chosen, src=0)
        return chosen[0]

    # ---- loading ------------------------------------------------------------------------------

    def read(self) -> dict[str, Any] | None:
        """The newest complete checkpoint's ``state`` (only that: the tensors wait for :meth:`restore`).

        The names of the tracked objects map to where they are, as ``TrainingRun`` checks that the
        checkpoint holds everything it tracks.
        """
        import torch.distributed.checkpoint as dcp

        found = complete_checkpoints(self.path)
        if not found:
            return None
        self._reading = found[-1]
        _read_metadata(self._reading)  # first, so broken metadata is our one line, not DCP's fallback and traceback
        progress = {"progress": _Pickled()}
        try:
            with _one_process_quiet():
                dcp.load(progress, checkpoint_id=str(self._reading))
            saved = progress["progress"].value
            if not isinstance(saved, dict) or not {"others", "tracked", "state"} <= saved.keys():
                raise ValueError("its progress entry is not this course's")
        except _LOAD_ERRORS as error:  # broken .metadata, a missing or truncated shard file
            raise unreadable_checkpoint(self._reading, error) from error
        self._others = saved["others"]
        return {**{name: f"DCP shards in {self._reading}" for name in saved["tracked"]}, **saved["state"],
                "checkpoint_folder": str(self._reading)}

    def restore(self, tracked: dict[str, Any]) -> None:
        """Load the folder :meth:`read` found into ``tracked``, each rank fetching its own shards.

        The saved tensors' names and shapes are checked against the model first, so a folder written
        for another model is one clear line instead of a failure deep inside DCP.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        assert self._reading is not None, "read() first"
        model, optimizer = tracked["model"], tracked["optimizer"]
        model_state, optimizer_state = get_state_dict(model, optimizer)
        check_same_model(self._reading, model_state)
        payload = {"model": model_state, "optimizer": optimizer_state}
        try:
            with _one_process_quiet():
                dcp.load(payload, checkpoint_id=str(self._reading))
        except _LOAD_ERRORS as error:  # a shard file truncated after the metadata was written
            raise unreadable_checkpoint(self._reading, error) from error
        set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optimizer"])
        for name, value in self._others.items():
            if name in tracked:
                tracked[name].load_state_dict(value)

    def close(self) -> None:
        """Wait for a save in flight, then release the background saves' process group."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


def _read_metadata(folder: Path) -> Any:
    """The DCP metadata of checkpoint ``folder``; one line naming the folder where it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(folder)).read_metadata()
    except _LOAD_ERRORS as error:
        raise unreadable_checkpoint(folder, error) from error


def check_same_model(folder: Path, model_state: dict[str, Any]) -> None:
    """Refuse, with one line, a checkpoint whose model tensors differ in name or shape from ``model_state``."""
    saved = {key[len("model."):]: value for key, value in _read_metadata(folder).state_dict_metadata.items()
             if key.startswith("model.")}
    missing = sorted(set(model_state) - set(saved))
    unexpected = sorted(set(saved) - set(model_state))
    if missing or unexpected:
        what = (f"this model has {missing[0]} and {len(missing) - 1} more tensor(s) the checkpoint lacks" if missing
                else f"the checkpoint has {unexpected[0]} and {len(unexpected) - 1} more tensor(s) this model lacks")
        raise UserError(f"{folder} was written for another model: {what}; resume with the same model flags, "
                        "or use another --checkpoint-dir")
    for key, tensor in model_state.items():
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(tensor.shape):
            raise UserError(f"{folder} was written for another model: {key} is {list(size)} there and "
                            f"{list(tensor.shape)} here; resume with the same model flags, or use another "
                            "--checkpoint-dir")
