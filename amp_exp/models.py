"""Model builders: a name and the dataset's input shape and classes in, an nn.Module out."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from amp_exp.config import MLPConfig, ModelConfig, TinyCNNConfig, TorchvisionModelConfig


class TinyCNN(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_mlp(input_shape: tuple[int, int, int], num_classes: int, cfg: MLPConfig) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = input_shape[0] * input_shape[1] * input_shape[2]
    for _ in range(cfg.depth):
        layers += [nn.Linear(width, cfg.hidden_dim), nn.ReLU(inplace=True)]
        width = cfg.hidden_dim
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class RepeatChannels(nn.Module):
    """Feeds single-channel images (MNIST) to models built for RGB, without new parameters."""

    def __init__(self, model: nn.Module, channels: int) -> None:
        super().__init__()
        self.model = model
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.expand(-1, self.channels, -1, -1))


@functools.cache
def torchvision_model_names() -> tuple[str, ...]:
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def build_torchvision(
    input_shape: tuple[int, int, int], num_classes: int, cfg: TorchvisionModelConfig
) -> nn.Module:
    import torchvision

    model = torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes)
    if input_shape[0] == 1:
        model = RepeatChannels(model, 3)
    return model


def build_model(cfg: ModelConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    builders: dict[type, Callable[..., nn.Module]] = {
        TinyCNNConfig: lambda: TinyCNN(input_shape[0], num_classes, cfg.width),
        MLPConfig: lambda: build_mlp(input_shape, num_classes, cfg),
        TorchvisionModelConfig: lambda: build_torchvision(input_shape, num_classes, cfg),
    }
    return builders[type(cfg)]()


def is_convolutional(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
