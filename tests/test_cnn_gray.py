"""Karras et al.'s Table I CNN (`cnn-gray`) and greyscale CIFAR-10 (`-o grayscale=true`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_data_loaders import make_cifar10

from p4bench.config import RunConfig
from p4bench.data.base import load_dataset
from p4bench.data.sources import Cifar10Dataset
from p4bench.errors import IncompatibleError
from p4bench.host.manager import default_registry
from p4bench.run.runner import run
from p4bench_p2p_fl.models import GrayCNN


def test_table_i_has_406922_parameters_and_matches_torch_layers():
    model = GrayCNN((1, 32, 32), 10)
    params = model.init(torch.Generator().manual_seed(0))
    assert model.num_parameters(params) == 406_922 and model.flat == 6272
    reference = nn.Sequential(  # Table I, dropout in evaluation mode
        nn.Conv2d(1, 16, 3),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(6272, 64),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(64, 10),
    ).eval()
    assert sum(p.numel() for p in reference.parameters()) == 406_922
    names = ["conv1", "conv2", "fc1", "fc"]
    layers = [m for m in reference if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        for name, layer in zip(names, layers):
            layer.weight.copy_(params[f"{name}.weight"])
            layer.bias.copy_(params[f"{name}.bias"])
    x = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.forward(params, x), reference(x))
    assert "cnn-gray" in {e.name for e in default_registry().entries("model")}


def test_refuses_flat_or_tiny_inputs():
    with pytest.raises(IncompatibleError, match="image features"):
        GrayCNN((64,), 10)
    with pytest.raises(IncompatibleError, match="6x6"):
        GrayCNN((1, 5, 5), 10)


def test_grayscale_cifar10_uses_bt601_luma(tmp_path):
    images, _ = make_cifar10(tmp_path)
    rgb = Cifar10Dataset().load(tmp_path)
    gray = load_dataset(
        Cifar10Dataset, tmp_path, RunConfig(dataset="cifar10", options={"grayscale": True})
    )
    assert gray.x_train.shape == (15, 1, 32, 32) and gray.x_train.dtype == np.float32
    assert gray.feature_shape == (1, 32, 32) and gray.x_test.shape == (4, 1, 32, 32)
    expected = (0.299 * images[:, 0] + 0.587 * images[:, 1] + 0.114 * images[:, 2]) / 255.0
    np.testing.assert_allclose(gray.x_train[:, 0], expected, atol=1e-6)
    assert np.array_equal(gray.y_train, rgb.y_train) and rgb.x_train.shape == (15, 3, 32, 32)
    default = load_dataset(Cifar10Dataset, tmp_path, RunConfig(dataset="cifar10"))
    assert default.feature_shape == (3, 32, 32)


def test_run_cnn_gray_on_grayscale_cifar10(tmp_path, monkeypatch, results_dir):
    make_cifar10(tmp_path, per_batch=12, test=10)  # 70 images
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path))
    config = RunConfig(
        method="fedavg",
        dataset="cifar10",
        model="cnn-gray",
        options={"grayscale": True},
        clients=3,
        rounds=1,
        local_steps=1,
        eval_fraction=0.0,
        results_dir=results_dir,
        seed=0,
    )
    result = run(config, track=False)
    assert result.info.num_parameters == 406_922 and np.isfinite(result.summary["accuracy_mean"])
