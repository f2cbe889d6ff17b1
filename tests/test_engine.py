"""The batched simulator, the per-client reference loop and the byte transport agree."""

from __future__ import annotations

import pytest
import torch

from p4bench.engine import MessageFormatError, Messages, decode, encode
from p4bench.engine.training import batched_loss_and_grad, reference_loss_and_grad
from p4bench.models import LinearSoftmax
from p4bench.run.runner import run


def _final(config):
    result = run(config, track=False)
    return result


@pytest.mark.parametrize("method", ["local", "fedavg"])
def test_batched_and_reference_runtimes_agree(small_config, method):
    config = small_config(method=method, client_rate=0.5, partitioner="alpha")
    batched = _final(config)
    reference = _final(config.replace(runtime="reference"))
    for key, value in batched.outcome.final_params.items():
        assert torch.allclose(value, reference.outcome.final_params[key], atol=1e-5), key
    assert (abs(batched.outcome.accuracy - reference.outcome.accuracy) < 1e-9).all()


def test_byte_transport_gives_the_same_result_as_the_simulator(small_config):
    config = small_config(method="fedavg", client_rate=0.5)
    batched = _final(config)
    over_bytes = _final(config.replace(runtime="bytes"))
    for key, value in batched.outcome.final_params.items():
        assert torch.allclose(value, over_bytes.outcome.final_params[key], atol=1e-5), key
    # the communication ledger counts the serialised frames: the simulator computes their
    # lengths without serialising, the bytes runtime measures the real frames
    assert over_bytes.outcome.bytes_sent == batched.outcome.bytes_sent > 0
    for mine, theirs in zip(batched.outcome.reports, over_bytes.outcome.reports):
        assert (mine.client_bytes_sent == theirs.client_bytes_sent).all()
        assert (mine.client_bytes_received == theirs.client_bytes_received).all()


def test_a_broadcast_is_one_message_here_and_costs_what_its_frames_cost(small_config):
    # P4 shares its measurements as one broadcast per client: the simulator keeps it one
    # message, the bytes runtime sends a frame to every other client; ids of 1 and 2 digits
    config = small_config(method="p4", clients=12, rounds=2, options={"group_size": 3})
    batched = _final(config)
    over_bytes = _final(config.replace(runtime="bytes"))
    assert over_bytes.outcome.bytes_sent == batched.outcome.bytes_sent > 0
    for mine, theirs in zip(batched.outcome.reports, over_bytes.outcome.reports):
        assert (mine.client_bytes_sent == theirs.client_bytes_sent).all()
        assert (mine.client_bytes_received == theirs.client_bytes_received).all()
    assert (batched.outcome.accuracy == over_bytes.outcome.accuracy).all()


def test_broadcast_frames_and_expansion():
    from p4bench.engine.messages import BROADCAST, broadcast_receipts, frame_sizes

    payload = {"known": torch.randn(3, 12)}
    messages = Messages(torch.tensor([0, 11, 5]), torch.full((3,), BROADCAST), payload)
    expanded = messages.expand_broadcasts(12)
    assert len(expanded) == 3 * 11 and not bool((expanded.src == expanded.dst).any())
    assert torch.equal(
        expanded.value("known")[expanded.src == 11], payload["known"][1].expand(11, 12)
    )
    per_message = [len(encode("share", 3, m)) for m in expanded.split()]
    assert frame_sizes("share", 3, messages, 12).sum() == sum(per_message)
    received = torch.zeros(12, dtype=torch.int64)
    received.index_add_(0, expanded.dst, torch.tensor(per_message))
    assert torch.equal(broadcast_receipts("share", 3, messages, 12), received)


def test_frame_sizes_equal_encoded_lengths():
    from p4bench.engine.messages import frame_sizes

    payload = {"update.w": torch.randn(4, 3, 5), "weight": torch.ones(4, dtype=torch.float64)}
    messages = Messages(torch.tensor([3, 12, 7, 105]), torch.tensor([-1, -1, 100, 2]), payload)
    sizes = frame_sizes("upload", 17, messages)
    assert sizes.tolist() == [len(encode("upload", 17, m)) for m in messages.split()]


def test_batched_gradients_match_autograd():
    model = LinearSoftmax((1, 8, 8), 10)
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.stack([model.init(gen)[k] for _ in range(4)]) for k in ("weight", "bias")}
    x = torch.rand(4, 6, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (4, 6), generator=gen)
    w = (torch.arange(6) < torch.tensor([6, 3, 1, 5]).unsqueeze(1)).float()
    loss_b, grad_b = batched_loss_and_grad(model, params, x, y, w)
    loss_r, grad_r = reference_loss_and_grad(model, params, x, y, w)
    assert torch.allclose(loss_b, loss_r, atol=1e-6)
    for key in params:
        assert torch.allclose(grad_b[key], grad_r[key], atol=1e-6)


def test_message_round_trip_and_rejection():
    payload = {
        "update.weight": torch.randn(1, 3, 4),
        "weight": torch.tensor([7.0], dtype=torch.float64),
    }
    message = Messages(torch.tensor([2]), torch.tensor([-1]), payload)
    frame = encode("upload", 5, message)
    exchange, round_index, back = decode(frame)
    assert (exchange, round_index, int(back.src[0]), int(back.dst[0])) == ("upload", 5, 2, -1)
    assert torch.equal(back.payload["update.weight"], payload["update.weight"])
    assert back.payload["weight"].dtype == torch.float64
    for bad in (
        b"",
        b"\x00" * 7,
        frame[:20],
        b"\xff" * 8 + frame[8:],
        frame.replace(b'"1"', b'"9"', 1),
    ):
        with pytest.raises(MessageFormatError):
            decode(bad)
    with pytest.raises(MessageFormatError, match="exceeds"):
        decode(frame, max_bytes=10)


def test_same_seed_reproduces_and_another_seed_differs(small_config):
    config = small_config(method="fedavg", client_rate=0.5)
    first = [r.accuracy.tolist() + [r.train_loss] for r in _final(config).outcome.reports]
    again = [r.accuracy.tolist() + [r.train_loss] for r in _final(config).outcome.reports]
    other = [
        r.accuracy.tolist() + [r.train_loss] for r in _final(config.replace(seed=2)).outcome.reports
    ]
    assert first == again
    assert first != other


def test_each_client_samples_its_own_batches(small_config):
    """Two clients holding identical data still draw different batches (own streams)."""
    from p4bench.rng import ClientRng, node_keys

    rng = ClientRng(node_keys(0, [0, 1]))
    index, _ = rng.subsets(torch.tensor([50, 50]), torch.tensor([10, 10]), 10)
    assert not torch.equal(index[0], index[1])


@pytest.mark.parametrize("setting, expected", [("1", "True"), ("0", "False")])
def test_freed_memory_policy_applies_once_and_can_be_switched_off(setting, expected):
    import os
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt only")
    code = "from p4bench.engine.memory import keep_freed_memory as k; print(k(), k())"
    env = {**os.environ, "P4BENCH_KEEP_HEAP": setting}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [expected, expected]


def test_batch_gradient_calls_a_mechanism_written_before_input_statistics():
    """A DP mechanism wrapper whose `step` predates the `sq_norms` keyword still works when
    the caller has no per-sample statistics to pass."""
    from types import SimpleNamespace

    from p4bench.engine.training import batch_gradient

    class OldMechanism:
        def step(self, ctx, params, x, y, mask, sample_rate, expected_batch, loss=None, aux=None):
            return {"w": torch.zeros(2)}, torch.zeros(2), torch.ones(2, dtype=torch.bool)

    ctx = SimpleNamespace(
        dp=OldMechanism(), config=SimpleNamespace(data_rate=0.5), rows=torch.arange(2)
    )
    train = SimpleNamespace(n=torch.tensor([4, 4]))
    grads, loss, done = batch_gradient(
        ctx,
        {"w": torch.zeros(2)},
        torch.zeros(2, 1, 3),
        torch.zeros(2, 1, dtype=torch.long),
        torch.ones(2, 1),
        train,
    )
    assert done.tolist() == [1.0, 1.0] and loss.dtype == torch.float64
