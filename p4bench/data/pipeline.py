"""A run's data, from the dataset plugin to the per-client tensors: load, features, the held-out
global test set, public records, partition, splits, the evaluation-clients cut and
normalisation, in the order the privacy claim needs (records leave before any client's share).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from p4bench.config import RunConfig
from p4bench.data.base import Dataset, Partitioner, load_dataset, run_partitioner
from p4bench.data.features import normalize_federated, normalize_samples, scatter_dataset
from p4bench.data.federated import FederatedData, build_federated_data, evaluation_clients_only
from p4bench.data.global_test import hold_out_global_test
from p4bench.data.paths import _data_dir
from p4bench.data.public import PublicData, public_data
from p4bench.data.unseen import split_unseen
from p4bench.errors import UsageError
from p4bench.rng import SEED_PARTITION, harness_rng

__all__ = ["RunData", "build_run_data"]


@dataclass
class RunData:
    """What a run trains and is evaluated on."""

    data: FederatedData
    public: PublicData | None  # records every client may read (a method that needs them)
    records: int  # the dataset's training records: the default delta's N, before any split
    partitioner: Partitioner  # its `report` describes the partition it made
    source: str = ""  # the data that loaded, where its name does not say (`ArrayDataset.source`)
    # `--unseen-fraction`: the clients set aside from training (`data` is the others), or None
    unseen: FederatedData | None = None


def build_run_data(
    config: RunConfig,
    dataset_cls: type[Dataset],
    partitioner_cls: type[Partitioner],
    *,
    needs_public_data: bool,
    needs_public_labels: bool,
    feature_device: str = "cpu",
) -> RunData:
    """The run's data for `config`. A tuning run on the evaluation clients alone
    (`federation_clients`) builds the data of the whole federation it is drawn from, exactly as
    that federation's runs do, then keeps the evaluation clients: same partition, same splits,
    no reported client's record."""
    whole = (
        config.replace(clients=config.federation_clients, federation_clients=None)
        if config.federation_clients is not None
        else config
    )
    dataset = load_dataset(dataset_cls, Path(_data_dir()), whole)
    records = len(dataset.y_train)
    source = dataset.source
    if config.features == "scatter":  # the feature cache is shared by devices: computed here
        dataset = scatter_dataset(dataset, device=feature_device)
    global_test = None
    if config.eval_set != "personal":  # the papers' held-out test set: before any client's share
        if config.features == "scatter" and config.feature_norm == "client":
            raise UsageError(
                "--eval global needs features that do not depend on a client's statistics: "
                "--feature-norm client normalises each client by its own; use sample or none"
            )
        dataset, global_test = hold_out_global_test(dataset, config.seed)
    public = None
    if needs_public_data:  # held-out records leave the dataset before any client gets a share
        dataset, public = public_data(
            dataset_cls, dataset, Path(_data_dir()), whole, labeled=needs_public_labels
        )  # PDSL's shared validation set Q
    elif config.hold_out_public:  # the same records leave as in a run that reads them
        dataset, _ = public_data(dataset_cls, dataset, Path(_data_dir()), whole)
    rng = harness_rng(config.seed, SEED_PARTITION)
    partitioner = partitioner_cls()
    partition = run_partitioner(
        partitioner, dataset, whole.clients, config.samples_per_client, rng, whole
    )
    data = build_federated_data(dataset, partition, config.eval_fraction, rng)
    if global_test is not None:
        data = dataclasses.replace(data, global_test=global_test)
    if config.federation_clients is not None:
        data = evaluation_clients_only(data)
        if data.num_clients != config.clients:
            raise UsageError(
                f"federation_clients={config.federation_clients} with "
                f"eval_fraction={config.eval_fraction} has {data.num_clients} evaluation "
                f"clients, but the run has clients={config.clients}"
            )
    unseen = None
    # they join after training (p4bench.data.unseen); never evaluation clients, so a tuning run
    # on the evaluation clients alone (`federation_clients`) has the same clients without them
    if config.unseen_fraction > 0 and config.federation_clients is None:
        data, unseen = split_unseen(data, config)
    return RunData(
        _normalized(data, config),
        public,
        records,
        partitioner,
        source,
        unseen=None if unseen is None else _normalized(unseen, config),
    )


def _normalized(data: FederatedData, config: RunConfig) -> FederatedData:
    if config.features == "scatter" and config.feature_norm == "client":
        return normalize_federated(data)  # the paper's: each client's own statistics (uncertified)
    if config.features == "scatter" and config.feature_norm == "sample":
        return normalize_samples(data)  # a function of each record alone: no privacy cost
    return data
