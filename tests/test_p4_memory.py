"""P4 in bounded memory: phase 1's batches and the recompute check's uploads in chunks of
clients give the same run as gathering everything at once."""

from __future__ import annotations

import numpy as np
import torch

import p4bench_p4.chunked_batches as chunked_batches
import p4bench_p4.chunked_exchange as chunked_exchange
import p4bench_p4.local_training as local_training
from p4bench.engine import Messages
from p4bench.engine.threats import Aggregator
from p4bench.run.runner import run


def test_chunked_batches_and_exchanges_give_the_same_private_run(small_config, monkeypatch):
    config = small_config(
        method="p4", clients=8, rounds=3, epsilon=8.0, options={"group_size": 4, "samples": 7}
    )
    whole = run(config, track=False)
    calls = {"steps": 0, "chunks": 0}
    step = local_training.chunked_dp_gradient

    def counted(*args, **kwargs):
        calls["steps"] += 1
        calls["chunks"] = max(calls["chunks"], len(args[-1]))
        return step(*args, **kwargs)

    monkeypatch.setattr(local_training, "chunked_dp_gradient", counted)
    monkeypatch.setattr(chunked_batches, "BATCH_CHUNK_BYTES", 1)  # one client per chunk
    monkeypatch.setattr(chunked_exchange, "EXCHANGE_CHUNK_BYTES", 1)  # one receiver per chunk
    chunked = run(config, track=False)
    assert calls["steps"] > 0 and calls["chunks"] == 8  # phase 1 really went client by client
    for key, value in whole.outcome.final_params.items():
        assert torch.allclose(value, chunked.outcome.final_params[key], atol=1e-6), key
    assert np.abs(whole.outcome.accuracy - chunked.outcome.accuracy).max() < 1e-9
    assert whole.summary["epsilon"] == chunked.summary["epsilon"]


def test_receiver_chunks_keep_each_receivers_inbox_whole_and_aggregate_alike():
    gen = torch.Generator().manual_seed(0)
    table = {"update.w": torch.randn(5, 3, generator=gen)}
    dst = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3])
    inbox = Messages(torch.arange(9), dst, table, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3]))
    chunks = chunked_exchange.receiver_chunks(inbox, budget=4 * 12)  # 4 messages of 12 bytes
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5], [6, 7, 8]]
    assert chunked_exchange.receiver_chunks(inbox, budget=1)[0].tolist() == [0, 1, 2]
    dst_whole, mean_whole = Aggregator().aggregate_by_destination(
        inbox, torch.ones(9, dtype=torch.float64)
    )
    monkeypatched = chunked_exchange.EXCHANGE_CHUNK_BYTES
    try:
        chunked_exchange.EXCHANGE_CHUNK_BYTES = 1
        dst_parts, mean_parts = chunked_exchange.aggregate_in_chunks(Aggregator(), inbox, 0)
    finally:
        chunked_exchange.EXCHANGE_CHUNK_BYTES = monkeypatched
    assert torch.equal(dst_whole, dst_parts)
    assert torch.allclose(mean_whole, mean_parts, atol=1e-7)
    assert torch.allclose(mean_parts[0], table["update.w"][:3].mean(0))
