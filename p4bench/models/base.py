"""Functional models: parameters are plain tensor dicts so the engine can stack them
along a client axis and vmap the per-client math. Registered by `p4bench.models.builtin`."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from p4bench.errors import IncompatibleError
from p4bench.models import stacked as layers
from p4bench.options import Option

Params = dict[str, torch.Tensor]


class Model(ABC):
    """A named architecture. `forward` sees one client's parameters (no client axis)."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()  # declared `config.options` keys (p4bench.options)

    def __init__(self, feature_shape: tuple[int, ...], num_classes: int) -> None:
        self.feature_shape = tuple(feature_shape)
        self.num_classes = num_classes

    @abstractmethod
    def init(self, generator: torch.Generator) -> Params:
        """Initial parameters (float32), drawn from `generator` (shared by all clients)."""

    @abstractmethod
    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """Logits (batch, num_classes) for inputs x (batch, *feature_shape)."""

    def num_parameters(self, params: Params) -> int:
        return sum(p.numel() for p in params.values())


class LinearSoftmax(Model):
    """One linear layer on the flattened features; softmax is in the loss."""

    name = "linear"
    description = "linear softmax classifier on flattened features"

    def init(self, generator: torch.Generator) -> Params:
        d = math.prod(self.feature_shape)
        bound = 1.0 / math.sqrt(d)  # torch.nn.Linear's default range
        weight = (torch.rand(self.num_classes, d, generator=generator) * 2 - 1) * bound
        bias = (torch.rand(self.num_classes, generator=generator) * 2 - 1) * bound
        return {"weight": weight, "bias": bias}

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(start_dim=1) @ params["weight"].T + params["bias"]


def _uniform(generator: torch.Generator, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch's default range for conv and linear layers."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def conv_init(
    generator: torch.Generator, params: Params, name: str, c_in: int, c_out: int, kernel: int
) -> None:
    """`<name>.weight` and `.bias` of a conv layer, uniform in +-1/sqrt(fan in) (torch's default)."""
    fan_in = c_in * kernel * kernel
    params[f"{name}.weight"] = _uniform(generator, (c_out, c_in, kernel, kernel), fan_in)
    params[f"{name}.bias"] = _uniform(generator, (c_out,), fan_in)


def linear_init(
    generator: torch.Generator, params: Params, name: str, d_in: int, d_out: int
) -> None:
    """`<name>.weight` and `.bias` of a dense layer, uniform in +-1/sqrt(d_in) (torch's default)."""
    params[f"{name}.weight"] = _uniform(generator, (d_out, d_in), d_in)
    params[f"{name}.bias"] = _uniform(generator, (d_out,), d_in)


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _group_count(channels: int, preferred: int = 27) -> int:
    """Groups for GroupNorm on the scatter channels: 27 when it divides (81, 243), else the
    largest divisor of `channels` not above `preferred`."""
    return max(g for g in range(1, min(preferred, channels) + 1) if channels % g == 0)


class ScatterCNN(Model):
    """Tramer & Boneh's CNN on ScatterNet features (ICLR 2021, "Differentially Private
    Learning Needs Better Features"), written functionally.

    GroupNorm without affine parameters (27 groups) on the K scatter channels, then
    - maps of at least 8x8 (CIFAR-10: 243x8x8): conv3x3(64) - tanh - maxpool2 -
      conv3x3(64) - tanh - linear to the classes;
    - smaller maps (MNIST: 81x7x7; digits: 81x2x2): conv3x3 stride 2 (16) - tanh -
      conv3x3(32) - tanh - linear(32) - tanh - linear to the classes.
    """

    name = "scatter-cnn"
    description = "Tramer & Boneh's GroupNorm + small CNN on ScatterNet features (K, H/4, W/4)"
    stacked = True  # `stacked_forward`: every client at once, convolutions as batched GEMMs (p4bench.models.stacked)

    def __init__(self, feature_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(feature_shape, num_classes)
        if len(self.feature_shape) != 3:
            raise IncompatibleError(
                f"model 'scatter-cnn' needs (channels, height, width) features, got {self.feature_shape}"
            )
        self.channels, height, width = self.feature_shape
        self.groups = _group_count(self.channels)
        self.wide = min(height, width) >= 8
        if self.wide:
            self.flat = 64 * (height // 2) * (width // 2)
        else:
            self.flat = 32 * _conv_out(height, 3, 2, 1) * _conv_out(width, 3, 2, 1)

    def init(self, generator: torch.Generator) -> Params:
        params: Params = {}
        if self.wide:
            conv_init(generator, params, "conv1", self.channels, 64, 3)
            conv_init(generator, params, "conv2", 64, 64, 3)
            linear_init(generator, params, "fc", self.flat, self.num_classes)
        else:
            conv_init(generator, params, "conv1", self.channels, 16, 3)
            conv_init(generator, params, "conv2", 16, 32, 3)
            linear_init(generator, params, "fc1", self.flat, 32)
            linear_init(generator, params, "fc", 32, self.num_classes)
        return params

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        h = F.group_norm(x.reshape(x.shape[0], *self.feature_shape), self.groups, eps=1e-5)
        if self.wide:
            h = torch.tanh(F.conv2d(h, params["conv1.weight"], params["conv1.bias"], padding=1))
            h = F.max_pool2d(h, 2)
            h = torch.tanh(F.conv2d(h, params["conv2.weight"], params["conv2.bias"], padding=1))
        else:
            h = torch.tanh(
                F.conv2d(h, params["conv1.weight"], params["conv1.bias"], stride=2, padding=1)
            )
            h = torch.tanh(F.conv2d(h, params["conv2.weight"], params["conv2.bias"], padding=1))
            h = torch.tanh(
                F.linear(h.flatten(start_dim=1), params["fc1.weight"], params["fc1.bias"])
            )
        return F.linear(h.flatten(start_dim=1), params["fc.weight"], params["fc.bias"])

    def stacked_forward(
        self, params: Params, x: torch.Tensor, tape: list[layers.Layer] | None = None
    ) -> torch.Tensor:
        """`forward` for every client at once: params (C, ...), x (C, b, ...) -> (C, b, L)."""
        clients, batch = x.shape[:2]
        h = F.group_norm(x.reshape(clients * batch, *self.feature_shape), self.groups, eps=1e-5)
        h = h.view(clients, batch, *self.feature_shape)
        if self.wide:
            h = torch.tanh(layers.conv2d(params, "conv1", h, padding=1, tape=tape))
            pooled = F.max_pool2d(h.reshape(clients * batch, *h.shape[2:]), 2)
            h = torch.tanh(
                layers.conv2d(
                    params,
                    "conv2",
                    pooled.view(clients, batch, *pooled.shape[1:]),
                    padding=1,
                    tape=tape,
                )
            )
        else:
            h = torch.tanh(layers.conv2d(params, "conv1", h, stride=2, padding=1, tape=tape))
            h = torch.tanh(layers.conv2d(params, "conv2", h, padding=1, tape=tape))
            h = torch.tanh(layers.linear(params, "fc1", h.reshape(clients, batch, -1), tape=tape))
        return layers.linear(params, "fc", h.reshape(clients, batch, -1), tape=tape)

    def first_layer_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(C*b, R, K) the first convolution's input rows for inputs x (C, b, ...): a
        function of the data alone (GroupNorm has no parameters here)."""
        clients, batch = x.shape[:2]
        h = F.group_norm(x.reshape(clients * batch, *self.feature_shape), self.groups, eps=1e-5)
        return layers._patch_rows(h, 3, 1 if self.wide else 2, 1)

    def stacked_rows(self, x: torch.Tensor) -> int:
        """Elements of the first convolution's unfolded input per client (the largest temporary)."""
        _, height, width = self.feature_shape
        stride = 1 if self.wide else 2
        positions = _conv_out(height, 3, stride, 1) * _conv_out(width, 3, stride, 1)
        return int(x.shape[1]) * positions * self.channels * 9


class SmallCNN(Model):
    """A small CNN on raw pixels (C, H, W): two conv3x3-tanh-maxpool2 blocks (32, 64
    channels, padded so any H, W >= 4 works), a 128-unit tanh layer and the classes.
    tanh follows Papernot et al.'s advice for DP-SGD, as in Tramer & Boneh's end-to-end CNNs.
    """

    name = "cnn"
    description = "small CNN on raw pixels: 2 x (conv3x3, tanh, maxpool) + 128-unit hidden layer"

    def __init__(self, feature_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(feature_shape, num_classes)
        if len(self.feature_shape) != 3:
            raise IncompatibleError(
                f"model 'cnn' needs image features (channels, height, width), got {self.feature_shape}"
            )
        self.channels, height, width = self.feature_shape
        if min(height, width) < 4:
            raise IncompatibleError(
                f"model 'cnn' needs images of at least 4x4 pixels, got {height}x{width}"
            )
        self.flat = 64 * (height // 4) * (width // 4)

    def init(self, generator: torch.Generator) -> Params:
        params: Params = {}
        conv_init(generator, params, "conv1", self.channels, 32, 3)
        conv_init(generator, params, "conv2", 32, 64, 3)
        linear_init(generator, params, "fc1", self.flat, 128)
        linear_init(generator, params, "fc", 128, self.num_classes)
        return params

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], *self.feature_shape)
        h = F.max_pool2d(
            torch.tanh(F.conv2d(h, params["conv1.weight"], params["conv1.bias"], padding=1)), 2
        )
        h = F.max_pool2d(
            torch.tanh(F.conv2d(h, params["conv2.weight"], params["conv2.bias"], padding=1)), 2
        )
        h = torch.tanh(F.linear(h.flatten(start_dim=1), params["fc1.weight"], params["fc1.bias"]))
        return F.linear(h, params["fc.weight"], params["fc.bias"])
