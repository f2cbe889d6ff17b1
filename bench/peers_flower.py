"""The same FedAvg on Flower's simulation engine (flwr 1.42: ServerApp, ClientApp, `run_simulation`).

Run by `bench/peers.py` with the bench's own environment's interpreter (`--install-flower`
builds it): `python bench/peers_flower.py DATA SETTINGS_JSON`. Each virtual SuperNode is one
client of p4bench's partition (its `partition-id`); its ClientApp trains with the very
function the opacus loop uses (`peers_client.train_client`: with DP, opacus per-example
DP-SGD inside the ClientApp, as Flower's opacus example does; Flower's own DP strategy
wrappers clip whole updates, another algorithm), so Flower's figure is that loop's work plus
Flower's orchestration. Flower's own `FedAvg` strategy aggregates, weighted by the
`num-examples` each client reports (n_i without DP, 1 with DP: p4bench's weights).
Ray starts a local cluster of its own (never joins one already running), bound to
127.0.0.1 with `threads` CPUs, one per ClientApp, no dashboard and a small object store.
Round times are the gaps between the server-side evaluations Flower runs before the first
round and after each one; a round's CPU, that of this process's whole tree (Ray's daemons
and workers included) between them. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from peers_client import (
    accuracy,
    aggregation_weight,
    client_generator,
    client_records,
    initial_state,
    load_shared,
    system_line,
    train_client,
    tree_cpu_s,
)

client_app = ClientApp()


@client_app.train()
def train(message: Message, context: Context) -> Message:
    config = message.content["config"]
    settings = json.loads(str(config["settings"]))
    torch.set_num_threads(1)  # one Ray CPU per ClientApp
    shared = load_shared(str(config["data"]))
    client = int(context.node_config["partition-id"])
    x, y = client_records(shared, client)
    state = message.content["arrays"].to_torch_state_dict()
    generator = client_generator(int(settings["seed"]), int(config["server-round"]) - 1, client)
    new = train_client(state, x, y, settings, generator)
    metrics = MetricRecord({"num-examples": aggregation_weight(len(y), settings)})
    return Message(
        content=RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=message
    )


def simulate(
    path: str, settings: dict[str, Any]
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Run the simulation: (seconds per round, CPU seconds per round of this process and
    Ray's, final global state)."""
    shared = load_shared(path)
    clients = len(shared["train_n"])
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    final: dict[str, dict[str, torch.Tensor]] = {}
    server_app = ServerApp()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        stamps.append(time.perf_counter())
        cpu_stamps.append(tree_cpu_s(os.getpid()))  # the driver, Ray's daemons and its workers
        final["state"] = arrays.to_torch_state_dict()
        return MetricRecord({"round": server_round})

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=clients,
            min_available_nodes=clients,
        )
        train_config = ConfigRecord(
            {"settings": json.dumps(settings), "data": os.path.abspath(path)}
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial_state(shared)),
            num_rounds=int(settings["rounds"]),
            train_config=train_config,
            evaluate_fn=evaluate,
        )

    threads = int(settings["threads"])
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {
                "address": "local",  # a cluster of its own, never one someone else started on this machine
                "num_cpus": threads,
                "num_gpus": 0,
                "_node_ip_address": "127.0.0.1",
                "object_store_memory": 200 * 1024 * 1024,
                "logging_level": "ERROR",
                "log_to_driver": False,
            },
        },
    )
    if len(stamps) != int(settings["rounds"]) + 1 or "state" not in final:
        raise RuntimeError(f"Flower ran {len(stamps) - 1} of {settings['rounds']} rounds")
    gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    return (
        gaps,
        [later - earlier for earlier, later in zip(cpu_stamps, cpu_stamps[1:])],
        final["state"],
    )


def main() -> None:
    path, settings = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(int(settings["threads"]))
    started = time.perf_counter()
    round_seconds, round_cpu, final = simulate(path, settings)
    shared = load_shared(path)
    line = system_line(
        "flower", settings, shared, round_seconds, round_cpu, accuracy(final, shared)
    )
    print(
        json.dumps({**line, "run_s": round(time.perf_counter() - started, 2), "pid": os.getpid()}),
        flush=True,
    )


if __name__ == "__main__":
    main()
