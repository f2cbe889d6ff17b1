"""Karras et al.'s Table I CNN for greyscale CIFAR-10 (`-o grayscale=true`), functional.

Conv(1->16, 3x3) - ReLU - Conv(16->32, 3x3) - ReLU - MaxPool 2x2 - Dropout 0.25 -
flatten (32 * 14 * 14 = 6272) - Linear(6272->64) - ReLU - Dropout 0.5 - Linear(64->10):
406,922 parameters on 1x32x32 inputs. Convolutions are unpadded with stride 1; the paper
leaves the activations unspecified, ReLU as the spec advises.

Dropout acts in training gradients only (`p4bench.models.dropout`): its masks are hashed from
each example and the model's current parameters, not drawn from torch's global generator,
so the batched simulator, the per-client runtimes and the per-example clipping path drop
the same units. Evaluation sees the identity, as `model.eval()` would give.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from p4bench.errors import IncompatibleError
from p4bench.models import Model, Params, conv_init, linear_init
from p4bench.models.dropout import hashed_dropout

__all__ = ["GrayCNN"]


class GrayCNN(Model):
    """Table I of Karras et al. (two unpadded conv3x3 + ReLU, maxpool, dropout 0.25, 64-unit
    ReLU layer, dropout 0.5); any channel count and image size of at least 6x6 is accepted."""

    name = "cnn-gray"
    description = (
        "Karras et al.'s Table I CNN (greyscale CIFAR-10: 406,922 parameters), dropout 0.25 and 0.5"
    )
    dropout = (0.25, 0.5)  # after the pooling, after the hidden dense layer (Table I)

    def __init__(self, feature_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(feature_shape, num_classes)
        if len(self.feature_shape) != 3:
            raise IncompatibleError(
                f"model 'cnn-gray' needs image features (channels, height, width), got {self.feature_shape}"
            )
        self.channels, height, width = self.feature_shape
        if min(height, width) < 6:
            raise IncompatibleError(
                f"model 'cnn-gray' needs images of at least 6x6 pixels, got {height}x{width}"
            )
        self.flat = (
            32 * ((height - 4) // 2) * ((width - 4) // 2)
        )  # two valid 3x3 convolutions, then pool 2

    def init(self, generator: torch.Generator) -> Params:
        params: Params = {}
        conv_init(generator, params, "conv1", self.channels, 16, 3)
        conv_init(generator, params, "conv2", 16, 32, 3)
        linear_init(generator, params, "fc1", self.flat, 64)
        linear_init(generator, params, "fc", 64, self.num_classes)
        return params

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], *self.feature_shape)
        h = F.relu(F.conv2d(h, params["conv1.weight"], params["conv1.bias"]))
        h = F.max_pool2d(F.relu(F.conv2d(h, params["conv2.weight"], params["conv2.bias"])), 2)
        h = hashed_dropout(h, x, params["fc.bias"], self.dropout[0], layer=1)
        h = F.relu(F.linear(h.flatten(start_dim=1), params["fc1.weight"], params["fc1.bias"]))
        h = hashed_dropout(h, x, params["fc.bias"], self.dropout[1], layer=2)
        return F.linear(h, params["fc.weight"], params["fc.bias"])
