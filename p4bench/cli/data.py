"""`p4bench data info | download | partition`: inspect, fetch and partition datasets.

Thin adapters over `p4bench.data.summary`, `p4bench.data.download` and the partitioners.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from p4bench.errors import DataError, UnknownNameError
from p4bench.host.manager import default_registry

if (
    TYPE_CHECKING
):  # numpy and the data modules are imported by the commands, not when the CLI is built
    import numpy as np

__all__ = ["register"]

_DATA_DIR_HELP = "data folder (default $P4BENCH_DATA_DIR or ~/.cache/p4bench/data)"


def _root(data_dir: Path | None) -> Path:
    from p4bench.data.paths import data_dir as default_data_dir

    return Path(data_dir) if data_dir is not None else default_data_dir()


def info_command(
    name: str | None = typer.Argument(
        None, help="one dataset: exit 2 with where to put its files if it is missing"
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help=_DATA_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """List every dataset, whether its files are present, and where they live."""
    from p4bench.data.paths import cache_dir
    from p4bench.data.summary import dataset_status

    root = _root(data_dir)
    rows = dataset_status(root, default_registry())
    if name is not None:
        chosen = [row for row in rows if row["name"] == name]
        if not chosen:
            raise UnknownNameError("dataset", name, [row["name"] for row in rows])
        row = chosen[0]
        if not row["present"]:
            raise DataError(
                f"dataset '{name}' is not present: put its files at {row['path']} "
                f"(or run `p4bench data download {name}` on a machine with network access)"
            )
        rows = chosen
    if as_json:
        typer.echo(
            json.dumps({"data_dir": str(root), "cache_dir": str(cache_dir()), "datasets": rows})
        )
        return
    table = Table(title=f"datasets in {root}")
    table.add_column("name")
    table.add_column("status")
    table.add_column("path", overflow="fold")
    for row in rows:
        if row["path"] is None:
            status = "[green]no files needed[/green]"
        elif row["present"]:
            status = "[green]present[/green]"
        else:
            status = f"[yellow]missing[/yellow] (p4bench data download {row['name']})"
        table.add_row(row["name"], status, row["path"] or "-")
    Console().print(table)


def download_command(
    name: str = typer.Argument(
        ..., help="dataset name: cifar10, cifar100, mnist, femnist, leaf-femnist"
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help=_DATA_DIR_HELP),
    force: bool = typer.Option(
        False, "--force", help="download again even if the files are present"
    ),
) -> None:
    """Download, verify (MD5) and unpack a dataset's official files; resumes partial downloads."""
    from p4bench.data.download import download_dataset

    download_dataset(name, _root(data_dir), force=force)


def partition_command(
    dataset: str = typer.Option("digits", help="dataset name (see `p4bench data info`)"),
    partitioner: str = typer.Option(
        "iid",
        help="a partitioner plugin: iid | alpha | shards | dirichlet | cbds | natural "
        "(see `p4bench list`)",
    ),
    clients: int | None = typer.Option(None, help="number of clients M"),
    samples_per_client: int | None = typer.Option(None, help="samples per client R (train + test)"),
    similarity: float | None = typer.Option(
        None, help="alpha partitioner: fraction of IID samples gamma"
    ),
    seed: int | None = typer.Option(None, help="random seed"),
    option: list[str] = typer.Option(
        [], "--option", "-o", help="partitioner/dataset option KEY=VALUE (repeatable)"
    ),
    preset: bool = typer.Option(
        False, "--preset", help="use the P4 paper's M and R for this dataset unless given"
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="write a client-by-class heatmap PNG here"
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help=_DATA_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="print per-client class counts as JSON"),
) -> None:
    """Partition a dataset as a run would and print each client's samples and classes."""
    from p4bench.config import parse_key_values, resolve_config
    from p4bench.data.base import load_dataset, run_partitioner
    from p4bench.data.partitioners import PRESETS
    from p4bench.data.summary import partition_counts, plot_partition_heatmap
    from p4bench.rng import SEED_PARTITION, harness_rng

    if preset and dataset in PRESETS:
        clients = clients if clients is not None else PRESETS[dataset]["clients"]
        if samples_per_client is None:
            samples_per_client = PRESETS[dataset]["samples_per_client"]
    overrides = dict(
        dataset=dataset,
        partitioner=partitioner,
        clients=clients,
        samples_per_client=samples_per_client,
        similarity=similarity,
        seed=seed,
        options=parse_key_values(option) or None,
    )
    config = resolve_config(None, overrides)
    registry = default_registry()
    dataset_cls = registry.get("dataset", config.dataset)
    partitioner_cls = registry.get("partitioner", config.partitioner)
    data = load_dataset(dataset_cls, _root(data_dir), config)
    # The runner's partition stream, so this shows exactly the partition a run would use.
    rng = harness_rng(config.seed, SEED_PARTITION)
    partition = run_partitioner(
        partitioner_cls, data, config.clients, config.samples_per_client, rng, config
    )
    counts = partition_counts(partition, data.pooled_labels(), data.num_classes)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "dataset": config.dataset,
                    "partitioner": config.partitioner,
                    "counts": counts.tolist(),
                }
            )
        )
    else:
        _print_partition(
            counts,
            data.class_names,
            f"{config.partitioner} partition of {config.dataset} (seed {config.seed})",
        )
    if plot is not None:
        plot_partition_heatmap(
            counts, data.class_names, plot, title=f"{config.dataset} / {config.partitioner}"
        )
        Console(stderr=True).print(f"heatmap written to {plot}")


def _print_partition(counts: np.ndarray, class_names: tuple[str, ...], title: str) -> None:
    import numpy as np

    table = Table(title=title)
    for column in ("client", "samples", "classes"):
        table.add_column(column, justify="right")
    table.add_column("largest classes (count)")
    for client, row in enumerate(counts):
        top = np.argsort(-row, kind="stable")[:4]
        largest = ", ".join(f"{class_names[c]}:{row[c]}" for c in top if row[c])
        table.add_row(str(client), str(int(row.sum())), str(int((row > 0).sum())), largest)
    sizes, present = counts.sum(axis=1), (counts > 0).sum(axis=1)
    console = Console()
    console.print(table)
    console.print(
        f"{len(counts)} clients, {int(sizes.sum())} samples; per client {int(sizes.min())}..{int(sizes.max())} "
        f"samples, {int(present.min())}..{int(present.max())} classes"
    )


def register(app: typer.Typer) -> None:
    """Add the `data` command group to the p4bench app."""
    data_app = typer.Typer(
        name="data", help="Inspect, download and partition datasets.", no_args_is_help=True
    )
    data_app.command("info")(info_command)
    data_app.command("download")(download_command)
    data_app.command("partition")(partition_command)
    app.add_typer(data_app, name="data")
