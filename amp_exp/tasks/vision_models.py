"""Image model builders: a name and the dataset's input shape and classes in, an nn.Module out."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from amp_exp.config.models import (
    MLPConfig,
    ModelConfig,
    TimmModelConfig,
    TinyCNNConfig,
    TorchvisionModelConfig,
)
from amp_exp.errors import ConfigError, first_line


@functools.cache
def l2_normalize_function(device_type: str, amp_safe: bool = True) -> type[torch.autograd.Function]:
    """Row-wise L2 normalization as a custom autograd function, computed in fp32.

    In fp16 the sum of squares overflows once an activation reaches 256, so the function opts
    out of autocast the way the AMP docs prescribe: ``custom_fwd(cast_inputs=torch.float32)``
    hands it fp32 inputs and ``custom_bwd`` runs its backward under the same autocast state.
    ``amp_safe=False`` builds the same function without the decorators, to show the difference.
    """
    if amp_safe:
        forward_wrap = torch.amp.custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        backward_wrap = torch.amp.custom_bwd(device_type=device_type)
    else:
        forward_wrap = backward_wrap = lambda fn: fn

    class L2Normalize(torch.autograd.Function):
        @staticmethod
        @forward_wrap
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            norm = x.pow(2).sum(dim=1, keepdim=True).add(1e-12).sqrt()
            y = x / norm
            ctx.save_for_backward(y, norm)
            return y

        @staticmethod
        @backward_wrap
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            y, norm = ctx.saved_tensors
            return (grad - y * (grad * y).sum(dim=1, keepdim=True)) / norm

    return L2Normalize


class L2Normalize(nn.Module):
    # Without autocast (precision=bf16_true) custom_fwd casts nothing: ask for fp32 directly.
    keep_in_fp32 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_normalize_function(x.device.type).apply(x)


class TinyCNN(nn.Module):
    def __init__(
        self, in_channels: int, num_classes: int, width: int, normalize_features: bool = False
    ) -> None:
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
            *([L2Normalize()] if normalize_features else []),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_mlp(input_shape: tuple[int, ...], num_classes: int, cfg: MLPConfig) -> nn.Module:
    """Flattens inputs of any shape: images, or the vectors of the user's own data."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
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


def build_torchvision(
    input_shape: tuple[int, int, int], num_classes: int, cfg: TorchvisionModelConfig
) -> nn.Module:
    import torchvision

    model = torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes)
    if input_shape[0] == 1:
        model = RepeatChannels(model, 3)
    return model


def build_timm(
    input_shape: tuple[int, int, int], num_classes: int, cfg: TimmModelConfig
) -> nn.Module:
    import timm  # validate checked that it is installed

    try:
        return timm.create_model(
            cfg.name,
            pretrained=False,
            num_classes=num_classes,
            in_chans=input_shape[0],
            **cfg.kwargs,
        )
    except Exception as error:
        raise ConfigError(
            f"model=timm model.name={cfg.name}: timm.create_model failed on "
            f"model.kwargs={cfg.kwargs}: {type(error).__name__}: {first_line(str(error))}"
        ) from None


def build_model(cfg: ModelConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    if isinstance(cfg, TinyCNNConfig):
        return TinyCNN(input_shape[0], num_classes, cfg.width, cfg.normalize_features)
    builders = {
        MLPConfig: build_mlp,
        TorchvisionModelConfig: build_torchvision,
        TimmModelConfig: build_timm,
    }
    return builders[type(cfg)](input_shape, num_classes, cfg)


def is_convolutional(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
