"""One FedAvg client as research code writes it, and the plain per-client opacus loop.

Imports torch and opacus only (not p4bench): Flower's simulation workers import it from
the bench's own environment (`bench/peers_flower.py`), and `bench/peers.py` runs the loop
from it. The workload is the one `bench/peers.py` hands to p4bench's `fedavg`:

- non-private: K SGD steps, each on round(s n_i) (at least 1) of the client's n_i training
  samples drawn without replacement, mean cross-entropy (p4bench's `fixed_size_batches`);
- private: K DP-SGD steps, Poisson sampling at rate s, per-example gradients from opacus's
  `GradSampleModule`, clipped to C and noised with N(0, sigma^2 C^2) by opacus's
  `DPOptimizer`, divided by the expected batch s n_i (p4bench's mechanism does the same);
- the server adds the weighted mean of the updates: weights n_i without DP, 1 with DP
  (p4bench's fedavg default `weighting`).

The shared data file (`torch.save` of plain tensors, written by `bench/peers.py` from
p4bench's partition) holds every client's padded training tensors and counts, the global
test set and the initial model, so every system starts from the same weights and records.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import time
from typing import Any

import torch

State = dict[str, torch.Tensor]
_SHARED: dict[str, dict[str, Any]] = {}  # one load per process (Flower's workers run many clients)


def _process_table() -> dict[int, list[str]]:
    """/proc/<pid>/stat fields after the command name, for every process (those that end
    while being read are left out)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    table[int(entry)] = stat.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
    return table


def _tree(root: int, table: dict[int, list[str]]) -> set[int]:
    members, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [
            pid for pid, fields in table.items() if int(fields[1]) == parent and pid not in members
        ]
        members.update(children)
        frontier.extend(children)
    return members & set(table)


def tree_rss_mb(root: int) -> float:
    """Resident memory of `root` and all its descendants (Ray's raylet and workers), in MB."""
    table = _process_table()
    return (
        sum(int(table[pid][21]) for pid in _tree(root, table)) * os.sysconf("SC_PAGE_SIZE") / 2**20
    )


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and its descendants, the reaped ones included (utime, stime,
    cutime, cstime): a round's CPU whatever processes did its work."""
    table = _process_table()
    ticks = sum(sum(int(v) for v in table[pid][11:15]) for pid in _tree(root, table))
    return ticks / os.sysconf("SC_CLK_TCK")


def load_shared(path: str) -> dict[str, Any]:
    """The shared data file, loaded once per process."""
    if path not in _SHARED:
        _SHARED[path] = torch.load(path, weights_only=True)
    return _SHARED[path]


def data_digest(train_x: torch.Tensor, train_y: torch.Tensor, train_n: torch.Tensor) -> str:
    """SHA-256 prefix of the client tensors a system trains on: equal digests, equal partition."""
    digest = hashlib.sha256()
    for tensor in (train_x, train_y, train_n):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def client_records(shared: dict[str, Any], client: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client `client`'s training records, flattened: (n_i, d) features, (n_i,) labels."""
    count = int(shared["train_n"][client])
    return shared["train_x"][client, :count].flatten(1), shared["train_y"][client, :count]


def client_generator(seed: int, round_index: int, client: int) -> torch.Generator:
    """A client's own stream for one round: batches and, with DP, its noise."""
    return torch.Generator().manual_seed(seed * 1_000_003 + round_index * 10_007 + client)


def train_client(
    state: State,
    x: torch.Tensor,
    y: torch.Tensor,
    settings: dict[str, Any],
    generator: torch.Generator,
) -> State:
    """K local steps from `state` (torch.nn.Linear's weight and bias): the new state."""
    from torch.nn import functional

    model = torch.nn.Linear(x.shape[1], state["weight"].shape[0])
    model.load_state_dict(state)
    count, rate, steps = len(y), float(settings["data_rate"]), int(settings["local_steps"])
    if not settings["private"]:
        optimizer = torch.optim.SGD(model.parameters(), lr=float(settings["lr"]))
        batch = max(1, round(rate * count))
        for _ in range(steps):
            chosen = torch.randperm(count, generator=generator)[:batch]
            optimizer.zero_grad()
            batch_loss = functional.cross_entropy(model(x[chosen]), y[chosen])
            batch_loss.backward()  # type: ignore[no-untyped-call]  # torch's stub of it is untyped
            optimizer.step()
        return {k: v.detach() for k, v in model.state_dict().items()}
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    private = GradSampleModule(model)
    optimizer = DPOptimizer(
        torch.optim.SGD(private.parameters(), lr=float(settings["lr"])),
        noise_multiplier=float(settings["noise_multiplier"]),
        max_grad_norm=float(settings["clip"]),
        expected_batch_size=rate * count,  # p4bench divides by s n_i, not an integer: a float
        generator=generator,
    )
    for _ in range(steps):
        chosen = torch.rand(count, generator=generator) < rate  # Poisson sampling
        optimizer.zero_grad()
        logits = private(x[chosen])
        # an empty batch still releases noise: a zero loss gives zero per-example gradients
        loss = (
            functional.cross_entropy(logits, y[chosen])
            if bool(chosen.any())
            else logits.sum() * 0.0
        )
        loss.backward()
        optimizer.step()
    return {k.removeprefix("_module."): v.detach() for k, v in private.state_dict().items()}


def aggregation_weight(count: int, settings: dict[str, Any]) -> float:
    """n_i without DP, 1 with DP (p4bench's fedavg `weighting` default)."""
    return 1.0 if settings["private"] else float(count)


def accuracy(state: State, shared: dict[str, Any]) -> float:
    """The global model's accuracy on the held-out global test set."""
    x, y = shared["test_x"].flatten(1), shared["test_y"]
    with torch.no_grad():
        predicted = (x @ state["weight"].T + state["bias"]).argmax(1)
    return float((predicted == y).double().mean())


def initial_state(shared: dict[str, Any]) -> State:
    return {"weight": shared["init_weight"].clone(), "bias": shared["init_bias"].clone()}


def run_loop(
    shared: dict[str, Any], settings: dict[str, Any]
) -> tuple[list[float], list[float], State]:
    """FedAvg with the clients trained one after another: (seconds per round, CPU seconds
    per round, final state)."""
    state, clients, round_seconds, round_cpu = initial_state(shared), len(shared["train_n"]), [], []
    for round_index in range(int(settings["rounds"])):
        started, cpu_started = time.perf_counter(), time.process_time()
        total = {k: torch.zeros_like(v) for k, v in state.items()}
        weights = 0.0
        for client in range(clients):
            x, y = client_records(shared, client)
            new = train_client(
                state, x, y, settings, client_generator(settings["seed"], round_index, client)
            )
            weight = aggregation_weight(len(y), settings)
            for k in total:
                total[k] += weight * (new[k] - state[k])
            weights += weight
        state = {k: state[k] + total[k] / weights for k in state}
        round_seconds.append(time.perf_counter() - started)
        round_cpu.append(time.process_time() - cpu_started)
    return round_seconds, round_cpu, state


def later_median(values: list[float]) -> float:
    """The median of the rounds after the first (which also warms up: Ray starts its workers)."""
    ordered = sorted(values[1:] or values)
    return ordered[len(ordered) // 2]


def system_line(
    system: str,
    settings: dict[str, Any],
    shared: dict[str, Any],
    round_seconds: list[float],
    round_cpu: list[float],
    final_accuracy: float,
) -> dict[str, Any]:
    """The fields every system reports about itself (the driver adds what it measures from outside)."""
    return {
        "system": system,
        "variant": "dp" if settings["private"] else "plain",
        "clients": len(shared["train_n"]),
        "rounds": len(round_seconds),
        "round_s": round(later_median(round_seconds), 4),
        "rounds_s": [round(s, 4) for s in round_seconds],
        "round_cpu_s": round(later_median(round_cpu), 4),
        "rounds_cpu_s": [round(s, 3) for s in round_cpu],
        "accuracy": round(final_accuracy, 4),
        "data_digest": data_digest(shared["train_x"], shared["train_y"], shared["train_n"]),
        "torch_threads": torch.get_num_threads(),
        "self_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    """`python bench/peers_client.py DATA SETTINGS_JSON`: the opacus loop, one JSON line."""
    path, settings = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(int(settings["threads"]))
    started = time.perf_counter()
    shared = load_shared(path)
    round_seconds, round_cpu, final = run_loop(shared, settings)
    line = system_line(
        "opacus-loop", settings, shared, round_seconds, round_cpu, accuracy(final, shared)
    )
    print(
        json.dumps({**line, "run_s": round(time.perf_counter() - started, 2), "pid": os.getpid()}),
        flush=True,
    )


if __name__ == "__main__":
    main()
