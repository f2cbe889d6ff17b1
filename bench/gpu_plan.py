"""The memory plan of bench/gpu.py's configurations on one 78 GB GPU, computed, not run
(issue 35, item 7): `python bench/gpu.py --plan` or `python bench/gpu_plan.py`.

For P4 (linear and scatter-cnn, 260 and 2,080 clients of 160 + 40 samples of 243x8x8
features) and DP-FedAvg (linear, 100,000 clients of 20 + 4 samples of 8x8), the bytes the
runner's plan counts (`p4bench.engine.devices.plan_memory`, `p4bench.engine.chunking.plan_work`):
the data, the clients' state (8 model copies per client), the method's own exchanges
(P4's grouping: one message per ordered pair of clients; bench/gpu.py times fixed groups,
so both are shown), and the DP step's per-example work, whose clients are chunked to the
budget left: per-example gradients of every parameter for the CNN, per-example logit
gradients for the linear model (it never holds per-example weight gradients). No tensor
is allocated: the parameters are counted from one model's init.
Prints one JSON object per configuration and a last line with the card size.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from p4bench.engine.chunking import dp_step_bytes, plan_work
from p4bench.engine.devices import plan_memory
from p4bench.errors import UsageError
from p4bench.models import LinearSoftmax, ScatterCNN
from p4bench.run.runner import state_bytes
from p4bench_p4.method import GROUPING_BYTES_PER_PAIR

CARD = 78 << 30  # the H100's usable memory the issue names
CONFIGS = (  # (method, model, clients, train, test, features)
    ("p4", "linear", 260, 160, 40, (243, 8, 8)),
    ("p4", "scatter-cnn", 260, 160, 40, (243, 8, 8)),
    ("p4", "linear", 2080, 160, 40, (243, 8, 8)),
    ("p4", "scatter-cnn", 2080, 160, 40, (243, 8, 8)),
    ("fedavg", "linear", 100_000, 20, 4, (1, 8, 8)),
)
MODELS = {"linear": LinearSoftmax, "scatter-cnn": ScatterCNN}
CLASSES, RATE = 10, 0.5


def plan(
    method: str,
    model_name: str,
    clients: int,
    train: int,
    test: int,
    features: tuple[int, ...],
    card: int = CARD,
) -> dict:
    model = MODELS[model_name](features, CLASSES)
    parameters = model.num_parameters(model.init(torch.Generator().manual_seed(0)))
    data = (
        clients * (train + test) * (math.prod(features) * 4 + 8)
    )  # float32 features, int64 labels
    state = state_bytes(parameters, clients)
    grouping = clients * clients * GROUPING_BYTES_PER_PAIR if method == "p4" else 0
    width = train  # a Poisson batch at rate s is at most the client's records
    one_client = dp_step_bytes(model, parameters, width, CLASSES)
    row = {
        "method": method,
        "model": model_name,
        "clients": clients,
        "parameters": parameters,
        "data_bytes": data,
        "state_bytes": state,
        "grouping_bytes": grouping,
        "dp_step_bytes_per_client": one_client,
        "dp_step_all_clients_bytes": one_client * clients,
    }
    gpu = torch.device("cuda")
    placement = plan_memory(gpu, data, state, free=card)
    resident = 0 if placement.stream_data else data
    row["data_placement"] = "streamed" if placement.stream_data else "resident"
    for label, working in (
        (("fixed_groups", 0), ("with_grouping", grouping)) if method == "p4" else (("run", 0),)
    ):
        try:
            budget = plan_work(gpu, resident + state + working, one_client, None, free=card)
        except UsageError as refused:
            row[label] = {"fits": False, "why": str(refused)}
            continue
        assert budget is not None
        row[label] = {
            "fits": True,
            "needed_bytes": resident + state + working + min(budget, one_client * clients),
            "dp_budget_bytes": budget,
            "clients_per_chunk": min(clients, max(1, budget // one_client)),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--card-gb", type=float, default=CARD / 2**30, help="the GPU's memory (GiB), default 78"
    )
    args = parser.parse_args(argv)
    card = int(args.card_gb * 2**30)
    fits = True
    for config in CONFIGS:
        row = plan(*config, card=card)
        fits &= all(v["fits"] for k, v in row.items() if k in ("fixed_groups", "run"))
        print(json.dumps(row), flush=True)
    print(
        json.dumps({"plan": "gpu", "card_bytes": card, "all_fit_as_bench_gpu_runs_them": fits}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
