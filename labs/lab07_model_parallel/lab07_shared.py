"""What the three Lab-07 scripts share: one model, one data order, and the measurements.

``01_tensor_parallel.py``, ``02_pipeline_parallel.py`` and ``03_2d_parallel.py`` train the same
transformer (Lab-04's, from ``common.models``) on the same batches, so a parallel run can be held
against the one-process run of the same script step by step.

- :func:`add_model_args` / :func:`shape_from_args`: ``--layers --width --heads --context``.
- :func:`build_model`: the seeded transformer with its attention's fused ``qkv`` projection split
  into ``q``, ``k`` and ``v`` (see :class:`HeadParallelAttention`: why a fused projection cannot be
  cut column-wise as it is).
- :func:`batch_for_step`: the global batch of step ``i``, a function of the seed and ``i`` alone,
  so a run resumed at step 10 sees what the uninterrupted run saw.
- :func:`predicted_tensor_parallel_traffic`: what the DTensor plan (``01_tensor_parallel.apply_tensor_parallel``) and
  what it must move; :class:`CollectiveTally` counts what it did move.
- :func:`pipeline_stage_module`, :class:`TimedStage` and :func:`bubble_formula`: the pipeline.
- :func:`write_lab_record`: one record per run (``common.results``), written by rank 0.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from common.cli import add_lr_arg, add_steps_arg, config_dict, non_negative_int, positive_int
from common.data.datasets import TEXT_VOCAB_SIZE, load_stdlib_text
from common.errors import FlagError
from common.models import DecoderOnlyTransformer, TransformerShape, add_transformer_args, transformer_shape
from common.results import make_record, provenance, write_record
from common.runtime.device import synchronize

LAB = "lab07"
SCHEDULES = ("gpipe", "1f1b", "interleaved")


# --------------------------------------------------------------------------------------------
# The model and the data


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The four numbers that size the transformer (``common.models.add_transformer_args``, as in Lab-04)."""
    return add_transformer_args(parser, "model (Lab-04's decoder-only transformer, see common/models.py)",
                                why={"width": "; tensor parallel cuts it across ranks",
                                     "heads": "; tensor parallel gives each rank whole heads"})


def add_training_flags(parser: argparse.ArgumentParser, *, batch: str, steps: int = 20) -> argparse.ArgumentParser:
    """``--steps --lr --warmup-steps``: every Lab-07 script takes the same optimiser steps; then ``--batch-size``,
    whose help (``batch``) says how the script splits the batch."""
    group = parser.add_argument_group("training")
    add_steps_arg(group, default=steps, each=", each on one global batch of --batch-size sequences")
    add_lr_arg(group, default=3e-3, optimizer="AdamW")
    group.add_argument("--warmup-steps", type=non_negative_int, default=2,
                       help="first steps left out of the timing (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help=f"{batch} (default: %(default)s)")
    return parser


DRY_RUN = "two steps, the first one untimed: checks that everything runs"  # --dry-run's help
#: The flags a resumed 2-D run must share with the saved one (the mesh may differ: DCP reshards on load).
RESUME_SETTINGS = ("layers", "width", "heads", "context", "batch_size", "seed", "lr")


def apply_dry_run(args: argparse.Namespace) -> argparse.Namespace:
    """``--dry-run``: two steps, the first one untimed (what the course's tiny runs and CI use). Then a run that
    would time no step at all is refused: its timings and bubble would be empty."""
    if args.dry_run:
        args.steps, args.warmup_steps = min(args.steps, 2), min(args.warmup_steps, 1)
    if args.warmup_steps >= args.steps:
        raise FlagError(f"--warmup-steps {args.warmup_steps} leaves none of the --steps {args.steps} timed; "
                        "give more --steps or fewer --warmup-steps")
    return args


def shape_from_args(args: argparse.Namespace) -> TransformerShape:
    return transformer_shape(args, TEXT_VOCAB_SIZE)


class HeadParallelAttention(nn.Module):
    """Lab-04's causal self-attention with separate ``q``, ``k``, ``v`` projections, whole heads per rank.

    Lab-04's attention computes queries, keys and values with one ``qkv`` matrix of ``3d`` output
    rows. Cut column-wise over 2 ranks as it is, rank 0 would get all the queries and half the keys:
    no head would be complete anywhere. Three matrices cut column-wise give each rank the queries,
    keys and values of ``heads / ranks`` whole heads, so attention needs no communication at all.
    The forward counts its heads from the width it receives (``d / ranks`` under tensor parallel),
    so the same module runs whole on one process and cut on many. Same numbers as Lab-04's: the
    three matrices are the three thirds of its ``qkv``.
    """

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        width = fused.proj.in_features
        self.head_width = width // fused.heads
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        with torch.no_grad():
            for linear, part in zip((self.q, self.k, self.v), fused.qkv.weight.split(width, dim=0)):
                linear.weight.copy_(part)
        self.proj = fused.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, -1, self.head_width).transpose(1, 2)
                   for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


def build_model(shape: TransformerShape, seed: int, device: torch.device | str = "cpu") -> DecoderOnlyTransformer:
    """The transformer, seeded: every rank, every strategy and every script start from the same weights."""
    torch.manual_seed(seed)
    model = DecoderOnlyTransformer(shape)
    for block in model.blocks:
        block.attention = HeadParallelAttention(block.attention)
    return model.to(device)


@functools.lru_cache(maxsize=2)
def training_text(context: int) -> Any:
    """Lab-04's text (the standard library's source) in windows of ``context`` characters, read once per process."""
    return load_stdlib_text(context).train


def batch_for_step(dataset: Any, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimiser step ``step``: ``batch_size`` windows drawn by ``(seed, step)`` alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    indices = torch.randint(0, len(dataset), (batch_size,), generator=generator).tolist()
    tokens, targets = zip(*(dataset[i] for i in indices))
    return torch.stack(tokens), torch.stack(targets)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each next character."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------------------------
# Checks: one error line each, before any process group or file exists


def check_tensor_parallel(shape: TransformerShape, degree: int, *, sequence_parallel: bool = False) -> None:
    """Tensor parallel gives each rank whole heads, so an equal slice of every width (the width is
    a multiple of the heads), and with sequence parallel an equal slice of the sequence."""
    if shape.heads % degree:
        raise FlagError(f"--heads {shape.heads} is not divisible by the tensor-parallel degree {degree}: "
                        "each rank computes whole attention heads (and width / degree columns of every layer); "
                        "use a head count that is a multiple of it")
    if sequence_parallel and shape.context % degree:
        raise FlagError(f"--context {shape.context} is not divisible by the tensor-parallel degree {degree}: "
                        "--sequence-parallel gives each rank context / degree positions")


def parse_mesh(text: str) -> tuple[int, int]:
    """argparse type: ``DPxTP`` such as ``2x2`` or ``4x1``."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected DPxTP such as 2x2 or 4x1, got {text!r}")
    return int(parts[0]), int(parts[1])


def check_mesh(mesh: tuple[int, int], world_size: int) -> None:
    if mesh[0] * mesh[1] != world_size:
        raise FlagError(f"--mesh {mesh[0]}x{mesh[1]} has {mesh[0] * mesh[1]} places but {world_size} process(es) "
                        "were started: the mesh's sizes must multiply to the world size")


# --------------------------------------------------------------------------------------------
# Tensor parallel (DTensor)


#: Bytes each rank sends, per byte of a collective's full tensor, in the ring algorithms NCCL and Gloo use
#: (the bus-bandwidth factors of NVIDIA's NCCL benchmarks, as in Lab-05): an all-reduce is a
#: reduce-scatter then an all-gather.
def ring_factor(kind: str, ranks: int) -> float:
    return (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks


def predicted_tensor_parallel_traffic(shape: TransformerShape, batch: int, degree: int, *,
                                      sequence_parallel: bool = False, element_bytes: int = 4) -> dict[str, Any]:
    """Bytes per training step that :func:`apply_tensor_parallel`'s plan makes each rank send, per collective.

    One activation of the residual stream is ``batch x context x width`` elements. Without sequence
    parallel: per block 2 all-reduces forward, 2 backward. With it: per block 2 all-gathers and 2
    reduce-scatters forward and the same backward (an all-gather's gradient is a reduce-scatter and
    the other way round), plus two all-gathers: the last block's output, which the head reads whole,
    and in backward the gradient of the first block's input, which the embeddings need whole
    (cutting a replicated tensor costs nothing forward; its gradient is gathered). A ring all-reduce
    sends ``2 (n - 1) / n`` of the tensor from each rank, an all-gather or a reduce-scatter ``(n - 1) / n``:
    sequence parallel sends the same bytes as plain tensor parallel, and two activations more.
    """
    if degree == 1:
        return {"total_bytes": 0, "by_collective": {}}
    activation = batch * shape.context * shape.width * element_bytes
    if sequence_parallel:
        counts = {"all_gather": 4 * shape.layers + 2, "reduce_scatter": 4 * shape.layers}
    else:
        counts = {"all_reduce": 4 * shape.layers}
    by_collective = {kind: {"count": count, "tensor_bytes": count * activation,
                            "bytes": round(count * activation * ring_factor(kind, degree))}
                     for kind, count in counts.items()}
    return {"total_bytes": sum(entry["bytes"] for entry in by_collective.values()), "by_collective": by_collective}


_COLLECTIVES = {"all_reduce": "all_reduce", "allreduce_": "all_reduce",
                "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather", "allgather_": "all_gather",
                "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
                "reduce_scatter_": "reduce_scatter", "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
                "broadcast": "broadcast", "broadcast_": "broadcast"}


class CollectiveTally(TorchDispatchMode):
    """Every collective issued while active: its count, the bytes of its full tensor (all-reduce: the
    tensor, all-gather: its output, reduce-scatter: its input), and what this rank sent (:func:`ring_factor`).

    DTensor issues its collectives as operators (``torch.ops._c10d_functional.*``), forward and
    backward, so a dispatch mode sees each one as it runs, with its real tensors (the way
    ``torch.distributed.tensor.debug.CommDebugMode`` counts them; this one also adds up sizes).
    ``ranks``: the size of the group they run over (the tensor-parallel degree).
    """

    def __init__(self, ranks: int) -> None:
        super().__init__()
        self.ranks = ranks
        self.by_collective: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        namespace, name = func._schema.name.split("::")
        kind = _COLLECTIVES.get(name) if namespace in ("_c10d_functional", "c10d_functional", "c10d") else None
        if kind is not None:
            tensor = out if kind == "all_gather" and isinstance(out, torch.Tensor) else args[0]
            if isinstance(tensor, (list, tuple)):
                tensor = tensor[0]
            entry = self.by_collective.setdefault(kind, {"count": 0, "tensor_bytes": 0, "bytes": 0})
            size = tensor.numel() * tensor.element_size()
            entry["count"] += 1
            entry["tensor_bytes"] += size
            entry["bytes"] += round(size * ring_factor(kind, self.ranks))
        return out

    @property
    def total_bytes(self) -> int:
        """Bytes this rank sent."""
        return sum(entry["bytes"] for entry in self.by_collective.values())


# --------------------------------------------------------------------------------------------
# Pipeline parallel


class PipelineStageModule(nn.Module):
    """A contiguous run of the transformer: the embeddings if it is the first stage, some blocks,
    the final norm and head if it is the last. Parameter names stay those of the whole model."""

    def __init__(self, model: DecoderOnlyTransformer, first: int, last: int, *, is_first: bool,
                 is_last: bool) -> None:
        super().__init__()
        self.token_embedding = model.token_embedding if is_first else None
        self.position_embedding = model.position_embedding if is_first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        self.norm = model.norm if is_last else None
        self.head = model.head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_embedding is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def stage_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """The blocks of each stage, as even as they divide: ``stage_layers(5, 2) == [(0, 2), (2, 5)]``."""
    if stages > layers:
        raise FlagError(f"{stages} pipeline stages need at least {stages} transformer blocks, the model has "
                        f"--layers {layers}: each stage holds one block or more; use more --layers or fewer "
                        "processes")
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def pipeline_stage_module(model: DecoderOnlyTransformer, stage: int, stages: int) -> PipelineStageModule:
    first, last = stage_layers(len(model.blocks), stages)[stage]
    return PipelineStageModule(model, first, last, is_first=stage == 0, is_last=stage == stages - 1)


def bubble_formula(stages: int, microbatches: int, chunks_per_rank: int = 1) -> float:
    """The idle fraction of each rank in a pipeline flush: ``(p - 1) / (v m + p - 1)`` with ``p`` ranks,
    ``m`` micro-batches and ``v`` stages per rank (``v = 1``: GPipe and 1F1B; interleaved: ``v > 1``)."""
    return (stages - 1) / (chunks_per_rank * microbatches + stages - 1)


def timed_stage_class() -> type:
    """:class:`torch.distributed.pipelining.PipelineStage` that adds up the time it computes.

    The schedule calls ``forward_one_chunk`` and ``backward_one_chunk`` for the computation of one
    micro-batch, and posts the sends and receives around them; the time inside the two, device
    synchronised, is this stage's compute. The rest of a step's wall time it waited: its bubble
    (plus the cost of moving activations, which this lab makes small beside the compute).
    """
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        compute_s = 0.0

        def _timed(self, method: Any, *args: Any, **kwargs: Any) -> Any:
            synchronize(self.device)
            began = time.perf_counter()
            out = method(*args, **kwargs)
            synchronize(self.device)
            self.compute_s += time.perf_counter() - began
            return out

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed(super().backward_one_chunk, *args, **kwargs)

    return TimedStage


# --------------------------------------------------------------------------------------------
# Records


def write_lab_record(args: argparse.Namespace, *, script: str, method: str, device: torch.device, world_size: int,
                     ctx: Any, metrics: dict[str, Any], config: dict[str, Any] | None = None,
                     notes: list[str] | None = None) -> Any:
    """Rank 0 writes one record (``common.results``) with the run's flags, its shape and ``metrics``
    (plus the sequences per step and per second, the names every course record uses), and says where."""
    tokens_per_s = metrics.get("tokens_per_s")
    common = {"world_size": world_size, "devices": world_size, "global_batch_size": args.batch_size,
              "samples_per_s": tokens_per_s / args.context if tokens_per_s else None}
    record = make_record(lab=LAB, script=script, method=method,
                         config=config_dict(args, resolved_device=str(device), **(config or {})),
                         metrics={**common, **metrics}, notes=notes or [],
                         provenance=provenance(device, world_size, {"distributed": ctx.describe()}))
    path = write_record(record, args.results_dir)
    print(f"record: {path}", flush=True)
    return path
