"""TF32 is confined to work outside the DP step (`p4bench.engine.precision`): P4's
`private_precision=tf32` turns it on for the private model's training and nowhere else, and
changes nothing on a CPU."""

from __future__ import annotations

import pytest
import torch

import p4bench_p4.local_training as local_training
from p4bench.engine.precision import tf32_matmuls
from p4bench.errors import ConfigError
from p4bench.run.runner import run


def test_tf32_is_on_inside_and_restored_after_an_error():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    with tf32_matmuls(False):
        assert matmul.allow_tf32 == before
    with pytest.raises(RuntimeError, match="inside"):
        with tf32_matmuls(True):
            assert matmul.allow_tf32 is True
            raise RuntimeError("inside")
    assert matmul.allow_tf32 == before


def _spy(monkeypatch, seen: dict[str, set[bool]]) -> None:
    """Record the TF32 flag where P4 computes the private model's inputs and the DP step."""
    logits_of, batch_gradient = local_training.logits_of, local_training.batch_gradient

    def spy_logits(*args, **kwargs):
        seen["private"].add(torch.backends.cuda.matmul.allow_tf32)
        return logits_of(*args, **kwargs)

    def spy_gradient(*args, **kwargs):
        seen["dp"].add(torch.backends.cuda.matmul.allow_tf32)
        return batch_gradient(*args, **kwargs)

    monkeypatch.setattr(local_training, "logits_of", spy_logits)
    monkeypatch.setattr(local_training, "batch_gradient", spy_gradient)


def test_private_tf32_covers_the_private_model_alone_and_changes_nothing_on_the_cpu(
    small_config, monkeypatch
):
    torch.backends.cuda.matmul.allow_tf32 = False
    summaries, flags = {}, {}
    for precision in ("fp32", "tf32"):
        seen: dict[str, set[bool]] = {"private": set(), "dp": set()}
        with monkeypatch.context() as patch:
            _spy(patch, seen)
            config = small_config(
                method="p4",
                model="cnn",
                clients=4,
                rounds=1,
                options={"group_size": 2, "private_precision": precision},
            )
            summaries[precision] = run(config, track=False).summary
        flags[precision] = seen
    assert flags["fp32"] == {"private": {False}, "dp": {False}}
    assert flags["tf32"] == {"private": {True}, "dp": {False}}  # the DP step stays float32
    assert torch.backends.cuda.matmul.allow_tf32 is False  # restored after the run
    for key in ("accuracy_per_client", "accuracy_proxy_mean", "epsilon"):
        assert summaries["tf32"][key] == summaries["fp32"][key]  # no TF32 on a CPU


def test_an_unknown_precision_is_refused(small_config):
    config = small_config(method="p4", clients=4, options={"private_precision": "bf16"})
    with pytest.raises(ConfigError, match="private_precision"):
        run(config, track=False)
