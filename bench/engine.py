"""Time per local step: batched simulator vs the per-client reference loop.

Workload: the `local` method's SGD step with the linear softmax model on digits-sized
data (8x8 features, 10 classes, 60 training samples per client, batch s = 0.2), for
M in {100, 1000} clients. The batched path is one vmapped step for all clients; the
reference path loops over clients with plain autograd, as research code does.
Prints one JSON object on the last line of stdout.

    python bench/engine.py [--clients 100 1000] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from p4bench.config import RunConfig
from p4bench.data import ClientTensors
from p4bench.engine.method import StepContext
from p4bench.engine.threats import Aggregator
from p4bench.engine.training import batched_loss_and_grad, local_sgd, reference_loss_and_grad
from p4bench.models import LinearSoftmax
from p4bench.rng import ClientRng, node_keys

SAMPLES, FEATURES, CLASSES = 60, (1, 8, 8), 10


def workload(clients: int) -> tuple[ClientTensors, dict[str, torch.Tensor], LinearSoftmax]:
    gen = torch.Generator().manual_seed(clients)
    x = torch.rand(clients, SAMPLES, *FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (clients, SAMPLES), generator=gen)
    model = LinearSoftmax(FEATURES, CLASSES)
    init = model.init(gen)
    params = {k: v.expand(clients, *v.shape).clone() for k, v in init.items()}
    return ClientTensors(x, y, torch.full((clients,), SAMPLES)), params, model


def context(model, rows: torch.Tensor, batched: bool) -> StepContext:
    gradient = batched_loss_and_grad if batched else reference_loss_and_grad
    return StepContext(
        config=RunConfig(data_rate=0.2),
        model=model,
        phase="bench",
        round=0,
        rows=rows,
        rng=ClientRng(node_keys(0, rows)),
        loss_and_grad=partial(gradient, model),
        aggregator=Aggregator(),
        num_clients=len(rows),
    )


def time_batched(clients: int, steps: int) -> float:
    train, params, model = workload(clients)
    ctx = context(model, torch.arange(clients), batched=True)
    local_sgd(ctx, params, train, 1, 0.1)  # warm-up
    start = time.perf_counter()
    local_sgd(ctx, params, train, steps, 0.1)
    return (time.perf_counter() - start) / steps


def time_reference(clients: int, steps: int) -> float:
    """The per-client loop: each client its own context and autograd step."""
    train, params, model = workload(clients)
    contexts = [context(model, torch.tensor([c]), batched=False) for c in range(clients)]
    rows = [train.rows(torch.tensor([c])) for c in range(clients)]
    singles = [{k: v[c : c + 1] for k, v in params.items()} for c in range(clients)]
    local_sgd(contexts[0], singles[0], rows[0], 1, 0.1)  # warm-up
    start = time.perf_counter()
    for c in range(clients):
        local_sgd(contexts[c], singles[c], rows[c], steps, 0.1)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = []
    for clients in args.clients:
        batched = time_batched(clients, args.steps)
        reference = time_reference(clients, args.steps)
        results.append(
            {
                "clients": clients,
                "batched_step_s": round(batched, 6),
                "reference_step_s": round(reference, 6),
                "speedup": round(reference / batched, 2),
            }
        )
        print(
            f"M={clients}: batched {batched * 1e3:.2f} ms/step, reference {reference * 1e3:.2f} ms/step",
            flush=True,
        )
    print(
        json.dumps(
            {"benchmark": "engine", "torch_threads": torch.get_num_threads(), "results": results}
        )
    )


if __name__ == "__main__":
    main()
