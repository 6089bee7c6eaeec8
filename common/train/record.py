"""A training run's record: every rank's measurements gathered, rank 0 writes and prints the summary.

The metrics are built by :func:`common.results.training_metrics` with the names the schema
documents (docs/results-schema.md). For DDP, every replica's parameter hash is compared: replicas
must end identical (sharded parameters, FSDP2's DTensors, differ by design and are not compared).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from torch import nn

from common.measure.timing import format_rate
from common.models import replica_digests
from common.results import make_record, provenance, training_metrics, write_record
from common.runtime.distributed import DistContext, gather_objects, print0
from common.units import format_bytes

if TYPE_CHECKING:  # types only: the run hands its meter and progress over
    from common.train.meter import RunMeter
    from common.train.progress import Progress

__all__ = ["write_run_record"]


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _replica_digests(model: nn.Module | None) -> list[dict[str, Any]] | None:
    """Every rank's parameter and buffer hashes (collective), or ``None`` for sharded or no model."""
    if model is None or any(hasattr(p, "to_local") for p in model.parameters()):
        return None
    digests = gather_objects(replica_digests(model))
    same = len({d["parameters"] for d in digests}) == 1
    print0(f"parameters identical on all {len(digests)} rank(s): {'yes' if same else 'NO'}")
    return digests


def write_run_record(*, lab: str, script: str, method: str, ctx: DistContext, distributed: bool, progress: Progress,
                     meter: RunMeter, model: nn.Module | None, config: dict[str, Any], metrics: dict[str, Any],
                     notes: Iterable[str], epochs: int, results_dir: Path, checkpoint: Path | None,
                     whole_epochs_from: int = 1) -> Path | None:
    """Gather (every rank calls this) and have rank 0 write the record; returns its path on rank 0.
    ``config``: the run's flags and settings (``common.cli.config_dict``), completed here with what the
    run resolved (device, global batch, loader)."""
    measured = meter.gathered(ctx.rank)
    digests = _replica_digests(model) if distributed else None
    if ctx.rank != 0:
        return None
    last_eval = progress.eval_history[-1] if progress.eval_history else {}
    all_metrics = training_metrics(
        train_loss=progress.train_loss, loss_at_step=progress.loss_at_step, epoch_time_s=progress.epoch_time_s,
        step_time=measured["step_time"], steps=progress.steps, epochs=epochs, world_size=ctx.world_size,
        memory=measured["memory"], test_loss=last_eval.get("test_loss"),
        test_accuracy=last_eval.get("test_accuracy"), eval_history=progress.eval_history,
        replica_digests=digests, global_batch_size=meter.global_batch, whole_epochs_from=whole_epochs_from)
    all_metrics.update(metrics)
    notes = list(notes)
    if digests is not None and not all_metrics["parameters_identical"]:
        notes.append("parameters differ between ranks: the replicas drifted apart (this is a bug)")
    if digests is not None and not all_metrics["buffers_identical"] and _has_batchnorm(model):
        notes.append("BatchNorm running statistics differ between ranks: each rank keeps its own unless DDP "
                     "broadcasts buffers before every forward; the checkpoint holds rank 0's")
    all_metrics["data_wait_s"] = meter.waited_s  # this process's steps: waiting for their batches
    extra = {"distributed": ctx.describe(), "placement": meter.placement} if distributed else None
    record = make_record(lab=lab, script=script, method=method,
                         config={**config, "resolved_device": str(ctx.device),
                                 "global_batch_size": all_metrics["global_batch_size"], "data_loader": meter.loader},
                         metrics=all_metrics, notes=notes, energy=measured["energy"],
                         provenance=provenance(ctx.device, ctx.world_size, extra))
    path = write_record(record, results_dir)
    _print_summary(all_metrics, measured, meter, notes, job=ctx.world_size > 1)
    if checkpoint is not None:
        print0(f"checkpoint: {checkpoint}")
    print0(f"record: {path}")
    return path


def _print_summary(metrics: dict[str, Any], measured: dict[str, Any], meter: RunMeter, notes: list[str], *,
                   job: bool) -> None:
    accuracy, median = metrics.get("test_accuracy"), measured["step_time"]["median_s"]
    print0("final: " + " | ".join(filter(None, [
        f"accuracy {100 * accuracy:.2f}%" if accuracy is not None else None,
        f"train loss {metrics['final_loss']:.4f}" if metrics["final_loss"] is not None else None,
        f"{format_rate(metrics['samples_per_s'])} samples/s" + (" (job)" if job else ""),
        f"median step {1000 * median:.1f} ms" if median is not None else "median step n/a (shorter than warm-up)",
        f"waiting for data {100 * meter.waited_s / meter.loop_s:.0f}% of the epochs" if meter.loop_s else None,
    ])))
    for entry in measured["memory"]:
        print0(f"peak memory rank {entry['rank']} {entry['device']}: {format_bytes(entry['peak_bytes'])} "
               f"({entry['source']})")
    for note in notes:
        print0(f"note: {note}")
