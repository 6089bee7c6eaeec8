"""What the three Lab-04 scripts share: the model flags, the two strategies, and memory measured
from real tensors.

``01_memory_budget.py`` predicts and measures, ``02_sharded_training.py`` trains, and
``03_largest_model.py`` searches for the largest model that fits; all three must build the same
model and wrap it the same way, or their numbers would not compare.

- :func:`add_model_args` / :func:`shape_from_args`: ``--layers --width --heads --context``.
- :func:`apply_strategy`: DDP (a full replica per rank), or FSDP2 (``fully_shard`` per block, then
  the root), optionally with activation checkpointing and bf16 mixed precision.
- :func:`tensor_bytes`: parameter, gradient and optimizer-state bytes held by *this* rank, summed
  over the real tensors (for FSDP2 the local shards of the DTensors).
- :class:`~common.measure.memory.SavedActivations` (from ``common.measure.memory``, shared with Lab-07):
  bytes the forward pass saved for backward, measured with autograd's saved-tensor hooks (works on CPU
  and GPU alike).
"""

from __future__ import annotations

import argparse
import gc
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import precision as precisions
from common.data.datasets import TEXT_VOCAB_SIZE
from common.errors import UserError
from common.runtime.distributed import print0
from common.train.amp import announce_bf16_emulation
from common.measure.memory import SavedActivations
from common.models import (DecoderOnlyTransformer, TransformerShape, add_transformer_args, transformer_parameter_count,
                           transformer_shape)
from common.units import format_bytes

LAB = "lab04"
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
#: The variants 01 and 03 compare: name -> (strategy, precision, activation checkpointing).
VARIANTS = {
    "ddp": ("ddp", "fp32", False),
    "fsdp": ("fsdp", "fp32", False),
    "fsdp+ac": ("fsdp", "fp32", True),
    "fsdp+bf16": ("fsdp", "bf16", False),
    "fsdp+ac+bf16": ("fsdp", "bf16", True),
}


# --------------------------------------------------------------------------------------------
# The model


def add_model_args(parser: argparse.ArgumentParser, *, layers: int = 8) -> argparse.ArgumentParser:
    """The four numbers that size the transformer (``common.models.add_transformer_args``, as in Lab-07; 03
    starts its doubling of the depth from a smaller ``layers``)."""
    return add_transformer_args(parser, "model (a decoder-only transformer, see common/models.py)", layers=layers,
                                why={"layers": "; FSDP2 shards each block as one unit",
                                     "width": ": each block holds about 12 d^2 parameters",
                                     "heads": "; must divide --width"})


def shape_from_args(args: argparse.Namespace) -> TransformerShape:
    return transformer_shape(args, TEXT_VOCAB_SIZE)


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def byte_size(text: str) -> int:
    """argparse type: ``512MiB``, ``2GiB``, ``1.5GB`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, 2GiB or 1e9, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


# --------------------------------------------------------------------------------------------
# Strategies


def check_strategy(strategy: str, precision: str, device: torch.device, *, world_size: int,
                   layers: int, say_overhead: bool = True) -> None:
    """Refuse, with one line each, what this device or this launch cannot run.

    - bf16 mixed precision on a GPU older than Ampere: its bf16 runs emulated, slower than fp32.
    - FSDP2 with more ranks than blocks: each block is gathered whole for its forward and backward,
      so with more ranks than blocks the gathered block (1/layers of the model) outweighs each
      rank's shard (1/ranks): adding ranks no longer lowers the peak memory.
    - bf16 with DDP: bf16 here is FSDP2's ``MixedPrecisionPolicy`` (DDP would need autocast: Lab-01).

    FSDP2 on one rank runs (it is the lesson's reference) and, with ``say_overhead``, says that it is pure
    overhead there (01 and 03, which check every variant in turn, leave it out).
    """
    if strategy == "ddp" and precision != "fp32":
        raise UserError("--precision bf16 is FSDP2's MixedPrecisionPolicy; use --strategy fsdp "
                        "(DDP would need autocast, which Lab-01 shows)")
    if precision == "bf16" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if precisions.gpu_support("bf16", capability) != "native":
            raise UserError(f"--precision bf16 needs a GPU of compute capability 8.0 (Ampere) or newer; "
                            f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}; "
                            "use --precision fp32")
    announce_bf16_emulation(precision, device)  # a CPU without bf16 units: one line, bf16 slower than fp32
    if strategy == "fsdp" and world_size > layers:
        raise UserError(f"--strategy fsdp on {world_size} ranks needs at least {world_size} blocks to shard, "
                        f"the model has --layers {layers}: each block is gathered whole, so with more ranks "
                        "than blocks the gathered block outweighs each rank's shard; use more --layers or "
                        "fewer ranks")
    if strategy == "fsdp" and world_size == 1 and say_overhead:
        print0("fsdp on 1 rank: nothing to shard across, so FSDP2's gathers and copies are pure overhead here; "
               "use --strategy ddp on one device, and FSDP2 when there are ranks to shard over")


def apply_strategy(model: nn.Module, strategy: str, device: torch.device, *, precision: str = "fp32",
                   activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                   compile_blocks: bool = False) -> nn.Module:
    """Wrap ``model`` for data-parallel training: ``ddp`` or ``fsdp`` (FSDP2).

    DDP keeps the whole model on every rank and all-reduces the gradients. FSDP2 replaces every
    parameter by a DTensor sharded along dim 0 (each rank keeps 1/N of the rows); ``fully_shard``
    on each block makes the block one communication unit: all-gather its parameters before its
    forward (and again before its backward), reduce-scatter its gradients after its backward, and
    free the gathered copy in between. The root call covers what is left (embeddings, final norm,
    head). ``reshard_after_forward=False`` keeps each block gathered from its forward to its backward
    (one all-gather per block per step instead of two, ZeRO-2's memory). ``compile_blocks`` compiles
    each block on its own (``block.compile()``, before wrapping, as torchtitan does): one compiled
    graph reused by every block, with FSDP2's hooks left between blocks where they belong.
    ``precision="bf16"`` gathers the parameters in bf16 and computes in bf16 while the
    sharded fp32 copy stays the one the optimiser updates, and gradients are reduced in fp32.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise UserError(f"--strategy {strategy} needs a process group (torch.distributed) and none is "
                        "initialised; start the script with torchrun or srun, or let it create a one-process "
                        "group (common.runtime.distributed.init_distributed(..., force_process_group=True))")
    model.activation_checkpointing = activation_checkpointing
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    if strategy == "ddp":
        if precision != "fp32":
            raise UserError("--precision bf16 is FSDP2's MixedPrecisionPolicy; use --strategy fsdp "
                            "(DDP would need autocast, which Lab-01 shows)")
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    if strategy != "fsdp":
        raise UserError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def language_model_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each next character; computed in fp32 whatever the model's dtype."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def random_batch(shape: TransformerShape, batch_size: int, device: torch.device,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids for a memory measurement: memory does not depend on which characters they are."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (batch_size, shape.context + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


# --------------------------------------------------------------------------------------------
# Speed against the hardware: tokens/s and model FLOPs utilisation


def flops_per_token(shape: TransformerShape) -> int:
    """Model FLOPs to train on one token: ``6 N + 12 L H Q T`` (the PaLM paper's appendix B).

    N: the parameters that multiply (every one but the two embedding tables, which are lookups);
    each takes 2 FLOPs per token forward and 4 backward. The attention scores and their weighted
    sum add ``12 L H Q T`` (L blocks, H heads of width Q, so H Q = width, over a context of T),
    counted whole although causal attention computes half of them (the usual convention). The
    recomputation of activation checkpointing is not counted: it is work the hardware does, not
    work the model needs (hardware FLOPs utilisation would count it).
    """
    multiplying = transformer_parameter_count(shape) - (shape.vocab_size + shape.context) * shape.width
    return 6 * multiplying + 12 * shape.layers * shape.width * shape.context


def throughput(shape: TransformerShape, samples_per_s: float | None, device: torch.device, precision: str,
               devices: int) -> dict[str, Any]:
    """Tokens/s of the whole job and its model FLOPs utilisation (MFU): the model's FLOPs per second
    over the devices' dense peak at the precision in force (``common.precision.utilisation``)."""
    tokens_per_s = samples_per_s * shape.context if samples_per_s else None
    per_token = flops_per_token(shape)
    speed = precisions.utilisation(tokens_per_s * per_token if tokens_per_s else None, device, precision, devices)
    return {"tokens_per_s": tokens_per_s, "flops_per_token": per_token, **speed}


def describe_throughput(speed: dict[str, Any]) -> str:
    tokens = f"{speed['tokens_per_s']:,.0f} tokens/s" if speed["tokens_per_s"] else "tokens/s n/a"
    return f"{tokens} | {precisions.describe_utilisation(speed)}"


# --------------------------------------------------------------------------------------------
# Memory, measured from tensors


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def nbytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def describe_held(entry: dict[str, Any]) -> str:
    """One rank's :func:`tensor_bytes` (with its ``rank``) in one line."""
    return (f"rank {entry['rank']} holds {format_bytes(entry['total'])}: parameters "
            f"{format_bytes(entry['parameters'])}, gradients {format_bytes(entry['gradients'])}, AdamW state "
            f"{format_bytes(entry['optimizer'])}")


def tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that this rank holds, from the tensors.

    Under FSDP2 ``model.parameters()`` are the sharded DTensors (outside forward/backward), so
    their local shards are what the rank keeps between steps; the gathered copy of a block exists
    only while that block computes.
    """
    params = list(model.parameters())
    counts = {"parameters": sum(nbytes(p) for p in params),
              "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
              "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            counts["optimizer"] += sum(nbytes(value) for value in state.values() if isinstance(value, torch.Tensor))
    counts["total"] = counts["parameters"] + counts["gradients"] + counts["optimizer"]
    return counts


def build_model(shape: TransformerShape, strategy: str, device: torch.device, *, precision: str = "fp32",
                activation_checkpointing: bool = False, seed: int = 0, on_meta: bool = False,
                reshard_after_forward: bool = True, compile_blocks: bool = False) -> nn.Module:
    """The transformer, seeded (every rank and every strategy start from the same weights), wrapped.

    ``on_meta=True`` never holds the whole model on a rank: it is built on the ``meta`` device (shapes,
    no memory), sharded, and only then given memory and initialised, shard by shard. That is how a
    model larger than one device is built; the weights then depend on the number of ranks.
    """
    torch.manual_seed(seed)
    if not on_meta:
        return apply_strategy(DecoderOnlyTransformer(shape), strategy, device, precision=precision,
                              activation_checkpointing=activation_checkpointing,
                              reshard_after_forward=reshard_after_forward, compile_blocks=compile_blocks)
    with torch.device("meta"):
        model = DecoderOnlyTransformer(shape)
    if strategy == "ddp":  # DDP copies rank 0's weights to the others: they must exist first
        model.to_empty(device=device)
        model.init_weights()
    model = apply_strategy(model, strategy, device, precision=precision,
                           activation_checkpointing=activation_checkpointing)
    if strategy == "fsdp":
        model.to_empty(device=device)
        with warnings.catch_warnings():  # DTensor warns that its random numbers on CPU are not coordinated
            warnings.filterwarnings("ignore", message="DTensor random operators")  # (fine for a memory test)
            model.init_weights()
    return model


def variant_name(strategy: str, precision: str = "fp32", activation_checkpointing: bool = False) -> str:
    """A record's method: ``ddp``, ``fsdp``, ``fsdp+ac``, ``fsdp+bf16``, ``fsdp+ac+bf16`` (the keys of
    :data:`VARIANTS`)."""
    parts = [strategy] + (["ac"] if activation_checkpointing else []) + ([precision] if precision != "fp32" else [])
    return "+".join(parts)


def measure_step(shape: TransformerShape, strategy: str, device: torch.device, *, batch_size: int,
                 precision: str = "fp32", activation_checkpointing: bool = False, seed: int = 0,
                 on_meta: bool = False) -> dict[str, Any]:
    """One AdamW training step on this rank; what it holds afterwards, measured from the tensors.

    ``parameters``, ``gradients`` and ``optimizer``: this rank's tensors (local shards under FSDP2);
    ``activations``: what the forward pass saved for backward; ``peak``: the CUDA allocator's peak
    over the whole step (on CPU the process's peak resident memory, which includes PyTorch itself);
    ``rss_bytes``: the resident memory after the step.
    """
    from common.measure.timing import peak_memory, process_rss_bytes, reset_peak_memory

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device)
    model = build_model(shape, strategy, device, precision=precision, activation_checkpointing=activation_checkpointing,
                        seed=seed, on_meta=on_meta)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = random_batch(shape, batch_size, device, seed=seed)
    with SavedActivations() as saved:
        loss = language_model_loss(model, tokens, targets)
    loss.backward()
    optimizer.step()  # creates AdamW's state: now every part of the budget exists
    held = tensor_bytes(model, optimizer)
    return {"parameters": held["parameters"], "gradients": held["gradients"], "optimizer": held["optimizer"],
            "activations": saved.bytes, "peak": peak_memory(device), "rss_bytes": process_rss_bytes()}
