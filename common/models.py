"""Models by name: the classic MNIST CNN, and torchvision's model zoo.

``build_model("mnist_cnn")`` is the network of pytorch/examples' ``mnist/main.py`` (and of the
course's Chapter 4 and Lab-02), defined once here so it cannot drift between chapters.
``build_model("resnet50", num_classes=10)`` is any torchvision classification model, randomly
initialised: weights are off by default because compute nodes cannot download them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import UserError

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
    rounding. Any number of channels and image size: the features are pooled to a 4x4 grid.
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
        return self.classifier(self.features(x))


def zoo_models() -> list[str]:
    """Names of torchvision's image classification models (``resnet18``, ``resnet50``, …)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, num_classes: int = 10, in_channels: int = 3, weights: str | None = None) -> nn.Module:
    """Build a model by name; unknown names raise a :class:`UserError` listing the valid ones.

    ``weights`` is passed to torchvision (e.g. ``"DEFAULT"``) and needs the weights already in the
    torch hub cache (``$TORCH_HOME``); it is ``None`` (random init) unless asked for.
    """
    if name in ("mnist_cnn", "net"):
        return MnistNet(num_classes=num_classes, in_channels=in_channels)
    if name == "plain_cnn":
        return PlainCNN(num_classes=num_classes, in_channels=in_channels)
    zoo = zoo_models()
    if name not in zoo:
        raise UserError(f"unknown model {name!r}; valid models: {', '.join([*LOCAL_MODELS, *zoo])}")
    import torchvision

    if in_channels != 3:
        raise UserError(f"{name} expects 3-channel images, the data has {in_channels}; "
                        "use --dataset synthetic/cifar10/imagefolder or the mnist_cnn model")
    try:
        return torchvision.models.get_model(name, weights=weights, num_classes=num_classes)
    except (ValueError, TypeError) as err:
        raise UserError(f"cannot build {name} with num_classes={num_classes} and weights={weights}: {err}") from None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


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
