"""FedDF, public unlabeled data, and FedAvg's Karras options (optimizer, epochs, lr_decay)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from p4bench.config import RunConfig, load_config_file
from p4bench.errors import DataError
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.models import LinearSoftmax
from p4bench.run.runner import prepare, run
from p4bench_baselines.feddf import distill
from p4bench_baselines.local_optim import AdamMoments, adam_step, steps_per_epoch

FAST = {"distill_steps": 20, "distill_eval_every": 5}  # a few server steps: tests stay quick
ROOT = Path(__file__).resolve().parents[1]


def _params(result) -> np.ndarray:
    params = result.outcome.final_params
    return np.concatenate(
        [params[k].reshape(len(params[k]), -1).numpy() for k in sorted(params)], axis=1
    )


def _registry() -> Registry:
    return Registry(create_plugin_manager(autoload=False))


# -- public data ------------------------------------------------------------------------------------
def test_public_pool_is_held_out_before_partitioning_and_never_reaches_a_client(small_config):
    config = small_config(method="feddf", clients=6, options={"public_pool": 0.25, **FAST})
    prepared = prepare(config, _registry())
    public, data = prepared.job.method.public_data, prepared.job.data
    from sklearn.datasets import (
        load_digits,
    )  # digits has no duplicate images: values identify records

    images = (load_digits().images.astype(np.float32) / 16.0)[:, None]
    count = len(images)
    assert len(public.held_out) == round(0.25 * count)
    assert public.description == f"digits held-out pool ({len(public.held_out)} records, unlabeled)"
    kept = np.setdiff1d(
        np.arange(count), public.held_out
    )  # the clients' pooled indices, in the original numbering
    owned = np.concatenate([kept[i] for i in data.client_indices])
    assert not np.intersect1d(owned, public.held_out).size and len(np.unique(owned)) == len(owned)
    u_train, u_val = public.splits()
    assert len(u_train) + len(u_val) == len(public.held_out) and len(u_val) == round(
        0.2 * len(public.held_out)
    )
    pool_rows = {row.tobytes() for row in torch.cat([u_train, u_val]).numpy()}
    assert pool_rows == {
        row.tobytes() for row in images[public.held_out]
    }  # the pool is exactly those records
    for split in (data.train, data.test):
        for client in range(data.num_clients):
            rows = split.x[client, : int(split.n[client])].numpy()
            assert not any(row.tobytes() in pool_rows for row in rows), client
    assert prepared.info.public_data == public.description


def test_methods_without_public_data_keep_every_record(small_config):
    prepared = prepare(small_config(method="fedavg", clients=6), _registry())
    assert prepared.job.method.public_data is None and prepared.info.public_data is None
    assert sum(len(i) for i in prepared.job.data.client_indices) == 6 * (
        1797 // 6
    )  # iid, equal sizes: no pool


def test_hold_out_public_gives_a_method_without_public_data_the_clients_of_a_feddf_run(
    small_config,
):
    """`hold_out_public`: fedavg's clients hold exactly the records FedDF's clients hold (same
    pool, same partition), so a comparison of the two is like for like (the karras preset)."""
    feddf = prepare(small_config(method="feddf", clients=6, options=FAST), _registry()).job.data
    fedavg = prepare(
        small_config(method="fedavg", clients=6, hold_out_public=True), _registry()
    ).job.data
    for ours, theirs in ((fedavg.train, feddf.train), (fedavg.test, feddf.test)):
        assert (
            torch.equal(ours.n, theirs.n)
            and torch.equal(ours.x, theirs.x)
            and torch.equal(ours.y, theirs.y)
        )
    plain = prepare(small_config(method="fedavg", clients=6), _registry()).job.data
    assert int(plain.train.n.sum()) > int(
        fedavg.train.n.sum()
    )  # without it, fedavg keeps the pool's records


def test_cifar10_public_data_is_cifar100_and_its_absence_is_one_clear_line(tmp_path, small_config):
    from p4bench.data.public import public_data
    from p4bench.data.sources import Cifar10Dataset

    dataset = Cifar10Dataset()
    with pytest.raises(DataError) as info:
        dataset.public_unlabeled(tmp_path)
    assert (
        "CIFAR-100" in str(info.value)
        and "\n" not in str(info.value)
        and "public_data=pool" in str(info.value)
    )
    # with public_data=pool, CIFAR-10 (like any dataset) gives a held-out pool instead; no file is read for it
    from p4bench.data.base import ArrayDataset

    fake = ArrayDataset(
        "cifar10",
        np.zeros((20, 3, 4, 4), np.float32),
        np.arange(20) % 10,
        np.zeros((5, 3, 4, 4), np.float32),
        np.arange(5) % 10,
        tuple("abcdefghij"),
    )
    reduced, public = public_data(
        dataset, fake, tmp_path, small_config(method="feddf", options={"public_data": "pool"})
    )
    assert len(reduced.y_train) + len(reduced.y_test) == 20 and len(public.held_out) == 5


# -- the method through the CLI, MLflow and the runtimes --------------------------------------------------
def test_feddf_through_the_cli_records_public_data_and_server_metrics(capsys, tmp_path):
    from mlflow.tracking import MlflowClient

    from p4bench.cli import main

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "feddf",
                "--clients",
                "5",
                "--rounds",
                "2",
                "--local-steps",
                "2",
                "--seed",
                "3",
                "-o",
                "distill_steps=20",
                "-o",
                "distill_eval_every=5",
                "--tracking-uri",
                uri,
                "--results-dir",
                str(tmp_path / "runs"),
                "--json",
            ]
        )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (info.value.code or 0) == 0 and summary["method"] == "feddf"
    assert summary["public_data"] == "digits held-out pool (359 records, unlabeled)"
    client = MlflowClient(tracking_uri=uri)
    assert (
        client.get_run(summary["run_id"]).data.tags["threat.public_data"] == summary["public_data"]
    )
    steps = [m.value for m in client.get_metric_history(summary["run_id"], "server_distill_steps")]
    seconds = client.get_metric_history(summary["run_id"], "server_distill_seconds")
    assert len(steps) == 2 and all(0 < s <= 20 for s in steps) and all(m.value > 0 for m in seconds)


def test_feddf_bytes_runtime_equals_simulation_with_dp_and_stays_certified(
    verify_full, small_config
):
    config = small_config(
        method="feddf", clients=5, rounds=2, epsilon=4.0, client_rate=0.6, options=FAST
    )
    simulated, serialised = (
        run(config, track=False),
        run(config.replace(runtime="bytes"), track=False),
    )
    np.testing.assert_allclose(_params(serialised), _params(simulated), atol=1e-5)
    np.testing.assert_allclose(serialised.outcome.accuracy, simulated.outcome.accuracy, atol=1e-6)
    assert simulated.summary["bytes_sent"] == serialised.summary["bytes_sent"]
    # distillation reads noisy models and public data: post-processing, no ledger entry, still certified
    # (the conformance kit checks that the ledger holds exactly FedAvg's planned client releases)
    for summary in (simulated.summary, serialised.summary):
        assert (
            summary["private"]
            and summary["epsilon_certified"]
            and summary["uncertified_reason"] is None
        )
        assert 0 < summary["epsilon"] <= 4.0 + 1e-6 and summary["clients_stopped"] == 0


def test_feddf_on_devices_equals_simulation(small_config):
    # one TLS peer per client plus a server peer, which loads the public pool itself (prepare)
    config = small_config(
        method="feddf",
        clients=4,
        rounds=2,
        eval_fraction=0.0,
        seed=7,
        noise_multiplier=1.0,
        noise_source="seeded",
        device_simulation=True,
        options=FAST,
    )
    timeouts = {
        "device_exchange_timeout_s": 30,
        "device_round_timeout_s": 120,
        "device_startup_timeout_s": 180,
    }
    simulated = run(config, track=False)
    device = run(
        config.replace(runtime="device", options={**FAST, "device_local_peers": 4, **timeouts}),
        track=False,
    )
    np.testing.assert_allclose(_params(device), _params(simulated), atol=1e-5)
    assert device.summary["client_bytes_sent"] == simulated.summary["client_bytes_sent"]


def test_feddf_passes_the_conformance_kit():
    from p4bench.testing import check_method

    # every check: state layout, simulation/reference/bytes with DP on and off, ledger against the
    # plan, capabilities (server, individual updates, aggregator, one deployed model), options.
    # The device runtime is left out (one TLS peer per client: tens of seconds); the bytes
    # runtime already serialises every message.
    report = check_method("feddf", clients=5, options=FAST)
    assert report.passed, report


def test_a_filtering_defense_also_picks_the_teachers(small_config, monkeypatch):
    import p4bench_baselines.feddf as feddf

    seen: list[tuple[int, int]] = []  # (teachers distilled, updates received) per round
    original_receive, original_distill = feddf.FedDF.server_receive, feddf.distill

    def receive(self, exchange, state, inbox, ctx):
        if exchange == "upload":
            seen.append((-1, len(inbox)))
        return original_receive(self, exchange, state, inbox, ctx)

    def spy(model, student, teachers, *args, **kwargs):
        seen[-1] = (len(next(iter(teachers.values()))), seen[-1][1])
        return original_distill(model, student, teachers, *args, **kwargs)

    monkeypatch.setattr(feddf.FedDF, "server_receive", receive)
    monkeypatch.setattr(feddf, "distill", spy)
    config = small_config(
        method="feddf",
        clients=8,
        rounds=2,
        attack="byzantine-random",
        malicious_fraction=0.25,
        defense="m-krum",
        options=FAST,
    )
    run(config, track=False)
    assert len(seen) == 2
    assert all(
        0 < taught < received for taught, received in seen
    )  # m-krum dropped some: they teach nothing


# -- distillation ----------------------------------------------------------------------------------------
def _toy(seed: int):
    model = LinearSoftmax((6,), 3)
    generator = torch.Generator().manual_seed(seed)
    student = {k: v.unsqueeze(0) for k, v in model.init(generator).items()}
    teachers = {
        k: torch.randn(4, *v.shape[1:], generator=generator) * 2 for k, v in student.items()
    }
    u = torch.randn(300, 6, generator=generator)
    return model, student, teachers, u[:240], u[240:]


def test_distillation_stops_early_when_the_validation_kl_does_not_fall():
    model, student, teachers, u_train, u_val = _toy(0)
    settings = dict(steps=200, eval_every=10, batch=32, temperature=1.0)
    # lr 0: the student never moves, so the first check finds no improvement and stops
    frozen, steps, _ = distill(
        model, student, teachers, u_train, u_val, lr=0.0, generator=torch.Generator(), **settings
    )
    assert steps == 10 and all(torch.equal(frozen[k], student[k]) for k in student)
    # a real step size keeps lowering the KL to the ensemble: no early stop
    learned, steps, kl = distill(
        model, student, teachers, u_train, u_val, lr=0.05, generator=torch.Generator(), **settings
    )
    from p4bench_baselines.feddf import _teacher_logits, _validation_kl

    start = _validation_kl(model, student, _teacher_logits(model, teachers, u_val), u_val, 1.0)
    assert steps == 200 and kl < 0.5 * start
    # fewer steps than U_train has inputs: the teachers' logits are computed batch by batch instead
    many = torch.randn(5000, 6, generator=torch.Generator().manual_seed(2))
    _, steps, few_kl = distill(
        model,
        student,
        teachers,
        many,
        u_val,
        steps=20,
        eval_every=10,
        batch=32,
        lr=0.05,
        temperature=1.0,
        generator=torch.Generator(),
    )
    assert steps == 20 and few_kl < start


def test_distillation_keeps_the_best_student_when_the_kl_rises():
    model, student, teachers, u_train, u_val = _toy(1)
    # an absurd step size overshoots: the validation KL rises at the first check, the start is kept
    result, steps, kl = distill(
        model,
        student,
        teachers,
        u_train,
        u_val,
        steps=100,
        eval_every=5,
        batch=32,
        lr=50.0,
        temperature=1.0,
        generator=torch.Generator(),
    )
    assert steps == 5 and all(torch.equal(result[k], student[k]) for k in student)


# -- FedAvg's local optimiser options ---------------------------------------------------------------------
def test_fedavg_default_is_the_explicit_sgd_and_adam_with_decay_differs(small_config):
    base = small_config(method="fedavg", clients=6, rounds=2, client_rate=0.5)
    default = run(base, track=False)
    explicit = run(
        base.replace(options={"optimizer": "sgd", "lr_decay": 1.0, "lr_scaling": "noble"}),
        track=False,
    )
    assert np.array_equal(_params(default), _params(explicit))  # bit for bit
    adam = run(
        base.replace(
            lr=0.01,
            options={"optimizer": "adam", "lr_decay": 0.9, "epochs": 1, "lr_scaling": "none"},
        ),
        track=False,
    )
    assert np.isfinite(_params(adam)).all() and not np.allclose(_params(adam), _params(default))
    assert adam.summary["accuracy_mean"] > 0.5


def test_epochs_set_the_local_steps_and_every_adam_step_is_a_ledger_release(
    verify_full, small_config
):
    # s = 0.25: an epoch is 4 batches, so E = 2 gives K = 8 DP steps per participation
    config = small_config(
        method="fedavg",
        clients=4,
        rounds=2,
        data_rate=0.25,
        epsilon=8.0,
        options={"optimizer": "adam", "epochs": 2, "lr_decay": 0.5, "lr_scaling": "none"},
        lr=0.01,
    )
    assert steps_per_epoch(0.25) == 4 and steps_per_epoch(0.0133333333) == 75
    prepared = prepare(config, _registry())
    assert (
        prepared.job.method.local_steps == 8 and prepared.job.method.privacy_plan()[0].steps == 16
    )
    result = run(config, track=False)
    assert result.summary["epsilon_certified"] and result.summary["clients_stopped"] == 0
    assert result.summary["epsilon"] <= 8.0 + 1e-6


def test_batched_adam_matches_torch_adam_row_by_row_and_idle_rows_stay():
    generator = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(3, 5, generator=generator)}
    grads = [torch.randn(3, 5, generator=generator) for _ in range(4)]
    active = [
        torch.tensor([1.0, 1.0, 0.0]),
        torch.tensor([1.0, 0.0, 0.0]),
        torch.ones(3),
        torch.ones(3),
    ]
    params, moments = dict(start), AdamMoments.zeros(start)
    for g, on in zip(grads, active):
        params, moments = adam_step(params, {"w": g}, moments, 0.1, on)
    for row in range(3):
        w = start["w"][row].clone().requires_grad_(True)
        optimiser = torch.optim.Adam([w], lr=0.1)
        for g, on in zip(grads, active):
            if on[row]:
                w.grad = g[row].clone()
                optimiser.step()
        torch.testing.assert_close(params["w"][row], w.detach(), rtol=1e-5, atol=1e-6)
    assert moments.t.tolist() == [4.0, 3.0, 2.0]


def test_fedavg_optimiser_options_are_refused_by_scaffold(small_config):
    from p4bench.errors import ConfigError

    with pytest.raises(ConfigError, match="options.optimizer"):
        prepare(small_config(method="scaffold", options={"optimizer": "adam"}), _registry())


# -- the Table II configuration ---------------------------------------------------------------------------
def test_karras_table2_config_loads_and_a_shortened_run_trains(small_config):
    from p4bench.options import validate_run_options

    path = ROOT / "examples" / "configs" / "karras-table2.yaml"
    values = load_config_file(path)
    config = RunConfig(**values)
    assert (config.clients, config.client_rate, config.rounds, config.lr) == (40, 0.5, 20, 5e-4)
    assert (
        config.options["epochs"] == 20
        and config.options["lr_decay"] == 0.995
        and config.options["optimizer"] == "adam"
    )
    assert round(config.data_rate * 1200) == 16 and steps_per_epoch(config.data_rate) == 75
    resolved = validate_run_options(config, _registry())  # every key belongs to a plugin of the run
    assert resolved["method"]["optimizer"] == "adam" and resolved["dataset"]["grayscale"] is True
    # shortened: digits (CIFAR-10 is not bundled), 8 clients, 4 rounds of one epoch (Table I's dropout
    # slows the first rounds: 2 rounds stay at chance, 4 reach about 0.45)
    options = {k: v for k, v in config.options.items() if k != "grayscale"} | {"epochs": 1}
    short = small_config(
        **{
            **values,
            "dataset": "digits",
            "clients": 8,
            "rounds": 4,
            "data_rate": 0.1,
            "lr": 0.005,
            "options": options,
        }
    )
    result = run(short, track=False)
    assert (
        result.summary["rounds_completed"] == 4 and result.summary["accuracy_mean"] > 0.2
    )  # above chance (0.1)
