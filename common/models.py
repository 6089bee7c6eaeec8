"""Models by name: the classic MNIST CNN, and torchvision's model zoo.

``build_model("mnist_cnn")`` is the network of pytorch/examples' ``mnist/main.py`` (and of the
course's Chapter 4 and Lab-02), defined once here so it cannot drift between chapters.
``build_model("resnet50", num_classes=10)`` is any torchvision classification model, randomly
initialised: weights are off by default because compute nodes cannot download them.
``DecoderOnlyTransformer`` is a small GPT-style language model (Lab-04) whose size is set by four
numbers (layers, width, heads, context); each block is its own module, so sharding wrappers such as
FSDP2's ``fully_shard`` can be applied block by block.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from common.cli import positive_int, unknown_names
from common.errors import FlagError, UserError, batch_too_small

LOCAL_MODELS = ("mnist_cnn", "plain_cnn")


class MnistNet(nn.Module):
    """Two conv layers, max-pool, dropout, two linear layers; outputs log-probabilities (use NLL loss)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)  # in channels, 32 filters, 3x3 kernel, stride 1
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)  # 64 channels x 12 x 12 after two convs and a 2x2 pool of 28x28
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


class PlainCNN(nn.Module):
    """Two conv + ReLU + max-pool blocks and two linear layers: no BatchNorm, no dropout.

    For equivalence checks (Lab-01): BatchNorm normalises with the statistics of the batch each
    replica sees, and dropout draws masks, so with either a replica of DataParallel or DDP computes
    a different function than one device; without them the methods agree to floating-point
    rounding. Any number of channels and any image of at least 4x4 (its two 2x2 pools): the features are
    pooled to a 4x4 grid.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) < 4:  # max_pool2d's traceback would not say which flag to change
            raise UserError(f"plain_cnn needs images of at least 4x4 (two 2x2 pools), got {x.shape[-2]}x{x.shape[-1]}: "
                            "give a larger --image-size")
        return self.classifier(self.features(x))


def zoo_models() -> list[str]:
    """Names of torchvision's image classification models (``resnet18``, ``resnet50``, …)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def unknown_model(name: str) -> str | None:
    """Why ``name`` is no model :func:`build_model` knows, close names named; ``None`` when it is one."""
    if name in (*LOCAL_MODELS, "net") or name in zoo_models():
        return None
    return unknown_names("model", [name], [*LOCAL_MODELS, *zoo_models()])


def model_name(value: str) -> str:
    """The argparse type of a ``--model`` flag: a name :func:`build_model` knows, checked as the flags are read, so
    a script that trains several times (Chapter 4's ``amp_training.py``) stops before its first run, not in it."""
    if (problem := unknown_model(value)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def build_model(name: str, num_classes: int = 10, in_channels: int = 3, weights: str | None = None) -> nn.Module:
    """Build a model by name; unknown names raise a :class:`UserError` naming close ones.

    ``weights`` is passed to torchvision (e.g. ``"DEFAULT"``) and needs the weights already in the
    torch hub cache (``$TORCH_HOME``); it is ``None`` (random init) unless asked for.
    """
    if name in ("mnist_cnn", "net"):
        return MnistNet(num_classes=num_classes, in_channels=in_channels)
    if name == "plain_cnn":
        return PlainCNN(num_classes=num_classes, in_channels=in_channels)
    if (problem := unknown_model(name)) is not None:
        raise UserError(problem)
    import torchvision

    if in_channels != 3:
        raise UserError(f"{name} expects 3-channel images, the data has {in_channels}; "
                        "use --dataset synthetic/cifar10/imagefolder or the mnist_cnn model")
    try:
        return torchvision.models.get_model(name, weights=weights, num_classes=num_classes)
    except (ValueError, TypeError) as err:
        raise UserError(f"cannot build {name} with num_classes={num_classes} and weights={weights}: {err}") from None


def check_image_input(name: str, batch_size: int, in_channels: int, image_size: int, num_classes: int = 10) -> None:
    """Run model ``name`` once, training, on a batch of the shape a run will give it, on the meta device (shapes
    only: nothing is computed or allocated), so that images it cannot take are one line before anything is timed,
    not its own traceback at the first step (``vit_b_16`` asserts 224x224, ``inception_v3`` needs 75x75 or more)."""
    try:
        with torch.device("meta"):
            build_model(name, num_classes, in_channels).train()(
                torch.empty(batch_size, in_channels, image_size, image_size))
    except (RuntimeError, AssertionError, ValueError) as err:
        raise UserError(batch_too_small(err) or f"{name} cannot run on {image_size}x{image_size} images: "
                        f"{str(err).splitlines()[0]} (choose another --image-size)") from None


def logits(output: torch.Tensor | tuple) -> torch.Tensor:
    """A classifier's class scores: GoogLeNet and Inception, training, return their auxiliary classifiers' too."""
    return output.logits if hasattr(output, "logits") else output


def input_shape(name: str, image_size: int) -> tuple[int, int]:
    """(channels, side) of the square images model ``name`` takes: the MNIST CNN always 1 x 28 x 28
    (its classifier is sized for it), any other model 3 channels of ``image_size``."""
    return (1, 28) if name in ("mnist_cnn", "net") else (3, image_size)


def add_image_model_args(parser: argparse.ArgumentParser, *, model: str, image_size: int) -> None:
    """``--model`` and ``--image-size`` of a script that feeds random images to a model by name."""
    parser.add_argument("--model", default=model,
                        help=f"{', '.join(LOCAL_MODELS)} or a torchvision classifier (default: %(default)s)")
    parser.add_argument("--image-size", type=positive_int, default=image_size,
                        help="side of the square input images; mnist_cnn always takes 1x28x28 (default: %(default)s)")


def parameter_digest(model: nn.Module, part: str = "all") -> str:
    """SHA-256 of a model's tensors, in order: equal digests mean bitwise-equal models.

    ``part`` is ``"all"`` (the state dict), ``"parameters"`` or ``"buffers"`` (e.g. BatchNorm's
    running statistics, which DDP keeps in step only with ``broadcast_buffers``). DDP replicas
    should agree after every step; comparing digests across ranks checks that without moving whole
    models around.
    """
    import hashlib

    tensors = {"all": lambda: model.state_dict().items(), "parameters": model.named_parameters,
               "buffers": model.named_buffers}[part]()
    digest = hashlib.sha256()
    for name, tensor in tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def replica_digests(model: nn.Module) -> dict[str, str]:
    """SHA-256 of the parameters and, separately, of the buffers (BatchNorm running statistics).

    DDP keeps parameters bitwise identical on every rank; buffers only when it broadcasts them
    before each forward, which is why they are hashed apart.
    """
    return {"parameters": parameter_digest(model, "parameters"), "buffers": parameter_digest(model, "buffers")}


# --------------------------------------------------------------------------------------------
# A decoder-only transformer (Lab-04)


@dataclass(frozen=True)
class TransformerShape:
    """The four numbers that size the model, plus the vocabulary (from the data)."""

    layers: int = 4
    width: int = 256
    heads: int = 4
    context: int = 128
    vocab_size: int = 128

    def check(self) -> "TransformerShape":
        if self.width % self.heads:
            raise FlagError(f"--width {self.width} must be a multiple of --heads {self.heads} "  # every rank alike
                            "(each head gets width / heads features)")
        return self

    @property
    def name(self) -> str:
        """``transformer-8x512``: blocks x width, what a report's model column shows."""
        return f"transformer-{self.layers}x{self.width}"

    def describe(self) -> dict[str, int | str]:
        return {"model": self.name, "layers": self.layers, "width": self.width, "heads": self.heads,
                "context": self.context, "vocab_size": self.vocab_size,
                "parameters": transformer_parameter_count(self)}


#: The flags that size the transformer, Lab-04's and Lab-07's alike: name -> (default, what it is).
TRANSFORMER_FLAGS = {"layers": (8, "transformer blocks"), "width": (512, "model width d"),
                     "heads": (8, "attention heads"), "context": (256, "characters per training sequence")}


def add_transformer_args(parser: argparse.ArgumentParser, title: str, *, layers: int = 8,
                         why: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """``--layers --width --heads --context`` (:data:`TRANSFORMER_FLAGS`) in a group named ``title``; ``why``
    adds a lab's reason to a flag's help (``{"width": "; tensor parallel cuts it across ranks"}``), ``layers``
    a smaller start for the depth."""
    group = parser.add_argument_group(title)
    for name, (default, what) in TRANSFORMER_FLAGS.items():
        group.add_argument(f"--{name}", type=positive_int, default=layers if name == "layers" else default,
                           help=f"{what}{(why or {}).get(name, '')} (default: %(default)s)")
    return parser


def transformer_shape(args: argparse.Namespace, vocab_size: int) -> TransformerShape:
    """The shape that the flags of :func:`add_transformer_args` name, checked."""
    return TransformerShape(layers=args.layers, width=args.width, heads=args.heads, context=args.context,
                            vocab_size=vocab_size).check()


def transformer_parameter_count(shape: TransformerShape) -> int:
    """The parameter count from the shape alone, without building anything.

    Per block: attention (q, k, v without bias and the output projection: 4 d² + d), the MLP
    (d -> 4d -> d: 8 d² + 5 d) and two LayerNorms (4 d): 12 d² + 10 d. Around the blocks: token and
    position embeddings (V d + T d), the final LayerNorm (2 d) and the output head (d V, no bias).
    """
    d, V, T = shape.width, shape.vocab_size, shape.context
    return shape.layers * (12 * d * d + 10 * d) + V * d + T * d + 2 * d + d * V


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # Queries, keys and values in one matrix multiply, without a bias: a bias on the keys would get
        # a zero gradient (softmax ignores a constant added to a whole row of scores), and AdamW would
        # turn the rounding noise in that gradient into updates as large as any other.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, length, width) -> (batch, heads, length, width / heads)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderOnlyTransformer(nn.Module):
    """A GPT-style character model: embeddings, ``layers`` blocks, a final norm and the output head.

    ``model.blocks`` is a ``ModuleList`` of :class:`TransformerBlock`: FSDP2 shards each block as
    one unit (``fully_shard(block)``), DDP sees one model. ``activation_checkpointing = True`` keeps
    only each block's input during the forward pass and recomputes the rest in backward (less
    memory, about one more forward pass of compute). No dropout: runs are deterministic, so DDP
    and FSDP2 can be compared step by step. The head is not tied to the token embedding, so every
    parameter belongs to exactly one module (simpler to shard and to count).
    """

    def __init__(self, shape: TransformerShape) -> None:
        super().__init__()
        shape.check()
        self.shape = shape
        self.token_embedding = nn.Embedding(shape.vocab_size, shape.width)
        self.position_embedding = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.ModuleList(TransformerBlock(shape.width, shape.heads) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab_size, bias=False)
        self.activation_checkpointing = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation: normal(0, 0.02) weights, zero biases, LayerNorms at identity.

        A method of its own so that a model built on the ``meta`` device (no memory) can be
        initialised after it was sharded: ``model.to_empty(device=...); model.init_weights()``.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (batch, length) of ids -> logits (batch, length, vocab_size)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # keep x, recompute the block in backward
            else:
                x = block(x)
        return self.head(self.norm(x))
