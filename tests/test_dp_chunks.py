"""A DP step in bounded memory (issue 35, item 2): clipped gradient sums over client
chunks sized by the memory budget are the same numbers as one call over every client."""

from __future__ import annotations

import pytest
import torch

from p4bench.config import RunConfig
from p4bench.engine.chunking import clients_per_chunk, memory_budget, per_client_bytes
from p4bench.engine.training import cross_entropy
from p4bench.models import Model, Params
from p4bench.privacy.clipping import clipped_gradient_sum


class TinyMLP(Model):
    """A model on the generic (per-example vmap) clipping path."""

    name = "tiny-mlp"

    def init(self, generator: torch.Generator) -> Params:
        d = int(torch.Size(self.feature_shape).numel())
        return {
            "w1": torch.randn(16, d, generator=generator) * 0.3,
            "b1": torch.zeros(16),
            "w2": torch.randn(self.num_classes, 16, generator=generator) * 0.3,
            "b2": torch.zeros(self.num_classes),
        }

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x.flatten(start_dim=1) @ params["w1"].T + params["b1"])
        return h @ params["w2"].T + params["b2"]


CLIENTS, WIDTH, FEATURES, CLASSES = 7, 5, 6, 3


def _batch() -> tuple[TinyMLP, Params, torch.Tensor, torch.Tensor, torch.Tensor]:
    model = TinyMLP((FEATURES,), CLASSES)
    generator = torch.Generator().manual_seed(4)
    one = model.init(generator)
    params = {
        k: v.expand(CLIENTS, *v.shape).clone()
        + 0.01 * torch.randn(CLIENTS, *v.shape, generator=generator)
        for k, v in one.items()
    }
    x = torch.randn(CLIENTS, WIDTH, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (CLIENTS, WIDTH), generator=generator)
    mask = (torch.rand(CLIENTS, WIDTH, generator=generator) > 0.2).float()
    return model, params, x, y, mask


def _budget_for(clients: int, params: Params) -> int:
    per_client = sum(int(v[0].numel()) for v in params.values())
    return clients * per_client_bytes(per_client, WIDTH, 4)


@pytest.mark.parametrize("chunk", [1, 3])
def test_chunked_sums_and_losses_equal_one_call_over_every_client(chunk):
    model, params, x, y, mask = _batch()
    with memory_budget(_budget_for(CLIENTS, params)):
        whole_sums, whole_losses = clipped_gradient_sum(model, params, x, y, mask, 0.5)
    with memory_budget(_budget_for(chunk, params)):
        assert (
            clients_per_chunk(
                CLIENTS,
                sum(int(v[0].numel()) for v in params.values()),
                WIDTH,
                4,
                torch.device("cpu"),
            )
            == chunk
        )
        sums, losses = clipped_gradient_sum(model, params, x, y, mask, 0.5)
    for key in whole_sums:  # clients are independent: bit for bit the same numbers
        assert torch.equal(sums[key], whole_sums[key]), key
    assert torch.equal(losses, whole_losses)


def test_a_budget_below_one_client_still_runs_one_client_at_a_time():
    model, params, x, y, mask = _batch()
    with memory_budget(1):
        sums, _ = clipped_gradient_sum(model, params, x, y, mask, 0.5)
    assert sums["w1"].shape == (CLIENTS, 16, FEATURES) and bool(torch.isfinite(sums["w1"]).all())


def test_losses_come_from_the_gradient_forward_and_match_a_plain_forward():
    model, params, x, y, mask = _batch()
    _, losses = clipped_gradient_sum(model, params, x, y, mask, 0.5)
    plain = torch.stack(
        [
            cross_entropy(model.forward({k: v[c] for k, v in params.items()}, x[c]), y[c], None)
            for c in range(CLIENTS)
        ]
    )
    assert torch.allclose(losses, plain, atol=1e-6)


def test_clipping_holds_per_example_in_every_chunk():
    model, params, x, y, mask = _batch()
    with memory_budget(_budget_for(2, params)):
        sums, _ = clipped_gradient_sum(model, params, x, y, mask, 1e-3)
    norm = torch.sqrt(sum(v.flatten(start_dim=1).pow(2).sum(1) for v in sums.values()))
    assert bool((norm <= 1e-3 * mask.sum(1) + 1e-9).all())  # a sum of b clipped gradients


def test_memory_budget_is_a_run_option_that_changes_no_result():
    base = RunConfig(method="dp-dsgd", clients=4, rounds=1)
    assert base.replace(memory_budget_gb=0.5).config_hash() == base.config_hash()


def test_a_budget_that_does_not_fit_is_refused_before_training_with_the_bytes(capsys, tmp_path):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "p4",
                "--rounds",
                "1",
                "--memory-budget",
                "1000000",
                "--results-dir",
                str(tmp_path),
            ]
        )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert info.value.code == 2
    assert (
        len(lines) == 1
        and "--memory-budget 1e+06 GB does not fit" in lines[0]
        and "GiB are free" in lines[0]
    )


def test_plan_refuses_fixed_needs_beyond_the_free_memory_and_picks_a_default_budget():
    from p4bench.engine.chunking import plan_work
    from p4bench.errors import UsageError

    cpu = torch.device("cpu")
    assert (
        plan_work(cpu, fixed_bytes=1 << 20, one_client_bytes=1 << 10, requested=None, free=8 << 20)
        == 4 << 20
    )
    assert (
        plan_work(
            cpu, fixed_bytes=1 << 20, one_client_bytes=1 << 10, requested=2 << 20, free=8 << 20
        )
        == 2 << 20
    )
    with pytest.raises(UsageError, match="does not fit in cpu memory"):
        plan_work(cpu, fixed_bytes=7 << 20, one_client_bytes=1 << 10, requested=None, free=8 << 20)


def test_p4_counts_its_grouping_in_the_plan():
    from p4bench_p4.method import P4

    # a few M x M float32 matrices (the share exchange is one broadcast per client, not per pair)
    assert P4.working_bytes(None, 1000) >= 1000 * 1000 * 12  # type: ignore[arg-type]


def test_a_run_in_small_chunks_ends_as_one_in_a_single_chunk():
    from p4bench.run.runner import run

    config = RunConfig(
        method="dp-dsgd", model="cnn", clients=4, rounds=2, seed=2, eval_fraction=0.0
    )
    whole = run(config, track=False).outcome
    chunked = run(
        config.replace(memory_budget_gb=1e-5), track=False
    ).outcome  # about one client per chunk
    for key in (
        whole.final_params
    ):  # the CNN's convolution kernel may depend on the batch of clients: float rounding
        assert torch.allclose(
            whole.final_params[key], chunked.final_params[key], rtol=0, atol=1e-5
        ), key
