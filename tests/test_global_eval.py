"""`--eval personal|global|both` (#31): a global test set held out of the dataset before
partitioning, never in a client's data, scored for every client's deployed model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from p4bench.cli import main
from p4bench.config import RunConfig
from p4bench.data.global_test import hold_out_global_test
from p4bench.host.manager import Registry, create_plugin_manager
from p4bench.run.runner import prepare, run


def _rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1)}


def test_the_global_test_set_is_the_dataset_test_split_and_in_no_clients_data(small_config):
    prepared = prepare(
        small_config(method="fedavg", eval_set="global", clients=6),
        Registry(create_plugin_manager()),
    )
    data = prepared.job.data
    held = data.global_test
    assert (
        held is not None and held.x.shape[0] == 1 and int(held.n[0]) == 360
    )  # digits' fixed last 20%
    clients = set()
    for tensors in (data.train, data.test):
        for c in range(data.num_clients):
            clients |= _rows(tensors.x[c, : int(tensors.n[c])].numpy())
    assert not clients & _rows(held.x[0].numpy())  # no client holds a record of the global test set
    assert (
        1797 - 360 - 6 < sum(int(t.n.sum()) for t in (data.train, data.test)) <= 1797 - 360
    )  # iid: equal shares


def test_without_a_test_split_a_stratified_fifth_is_held_out():
    from p4bench.data.base import ArrayDataset

    x = np.arange(100, dtype=np.float32)[:, None]
    y = np.repeat(np.arange(4), 25)
    dataset = ArrayDataset("toy", x, y, x[:0], y[:0], ("a", "b", "c", "d"))
    rest, held = hold_out_global_test(dataset, seed=1)
    assert int(held.n[0]) == 20 and np.bincount(held.y[0].numpy()).tolist() == [5, 5, 5, 5]
    assert len(rest.y_train) == 80 and not _rows(rest.x_train) & _rows(held.x[0].numpy())
    again, _ = hold_out_global_test(dataset, seed=1)
    assert np.array_equal(again.x_train, rest.x_train)  # seeded


def test_summaries_carry_both_figures_and_the_headline_follows_eval(small_config):
    personal = run(small_config(method="p2p-fl", rounds=2), track=False).summary
    assert personal["eval_set"] == "personal" and personal["accuracy"] == personal["accuracy_mean"]
    assert "accuracy_global_mean" not in personal
    held = run(small_config(method="p2p-fl", rounds=2, eval_set="global"), track=False).summary
    assert held["eval_set"] == "global" and held["accuracy"] == held["accuracy_global_mean"]
    assert (
        held["accuracy_global_min"] <= held["accuracy_global_mean"] <= held["accuracy_global_max"]
    )
    both = run(small_config(method="p2p-fl", rounds=2, eval_set="both"), track=False).summary
    assert (
        both["accuracy"] == both["accuracy_mean"]
        and both["accuracy_global_mean"] == held["accuracy_global_mean"]
    )
    # the default keeps every earlier run's config hash
    assert (
        RunConfig(method="p2p-fl").config_hash()
        == RunConfig(method="p2p-fl", eval_set="personal").config_hash()
    )


def test_cli_eval_prints_both_and_refuses_a_bad_value(capsys, results_dir):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "run",
                "--method",
                "fedavg",
                "--rounds",
                "1",
                "--eval",
                "global",
                "--results-dir",
                results_dir,
                "--json",
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["eval_set"] == "global" and "final" not in summary
    assert (
        "test accuracy mean (global test set)" in err
        and "test accuracy mean (own test splits)" in err
    )
    with pytest.raises(SystemExit) as info:
        main(["run", "--method", "fedavg", "--eval", "everywhere", "--results-dir", results_dir])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and "eval_set" in (out + err) and "Traceback" not in (out + err)
