"""P4L (Arapakis et al., "Privacy-Preserving Peer-to-Peer Learning for Infrastructureless
Setups"): method `p4l`. Secure aggregation by Paillier-encrypted synergy chains, no DP.

Every round:
1. every peer trains locally (E epochs or the run's local_steps, plain SGD) on its
   records minus a held-out validation split (`val_fraction`);
2. `contribute`: each peer hands itself the model it will add to synergies (a message to
   itself that never crosses the network; it is where a Byzantine peer's message attack,
   e.g. kde-noise, replaces what it contributes);
3. `hop<t>` / `ack<t>` for t < ticks: the synergies of the round's public plan
   (`plan.py`) run their chains (`peer.py`): the initiator encrypts its model under its
   Paillier key, each hop adds its own encrypted model, signs and forwards, with beacons,
   retries, fallback and deadlines;
4. `aggregate`: each initiator holding a final message decrypts the sum, proves the
   decryption (it reveals the Paillier randomness) and sends it to every member, which
   checks the proof and the signatures, divides by N and applies accept-if-better.

Concurrent synergies (the paper leaves merging open, A5): a peer may join several
synergies of a round, always contributing the same model; it then receives several
averages. `merge=best` (default) keeps the best of its own model and the accepted
averages on its validation split, which is what applying the paper's gate to the
averages one after another gives in any order; `merge=mean` averages the accepted ones.

Stopping (mrt/mrr, A4): the run ends once a fraction `mrr` of the peers took part in at
least `mrt` completed synergies (or after the run's rounds, whichever comes first).

Privacy: P4L uses no DP and the harness records it so (epsilon none, `secure_aggregation`
and `min_group` = size_min - 1 in the summary); a DP run (--epsilon) is refused. Under
the paper's non-collusion assumption no peer sees another's plaintext model; the
initiator learns the sum of the other sz - 1 models and every member the sum of the
others. Individual updates are never visible, so defenses that inspect them are refused
(`Capabilities.hides_individual_updates`); accept-if-better works.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p4bench.data import ClientTensors
from p4bench.engine import Capabilities, Exchange, LocalUpdate, Messages, Method
from p4bench.engine.messages import UPDATE_PREFIX
from p4bench.engine.method import Phase, Step, StepContext
from p4bench.engine.method_kit import replicate
from p4bench.engine.state import State, vectorize
from p4bench.engine.training import local_sgd
from p4bench.errors import ConfigError
from p4bench.models import Params
from p4bench.options import resolve_options
from p4bench_p2p_fl.policies import exact_scores, validation_split
from p4bench_p4l.chain_crypto import ChainCrypto
from p4bench_p4l.host_messages import host_rows, on_host, pack
from p4bench_p4l.merge import merge_candidates
from p4bench_p4l.metrics import derived_metrics, flush_stats
from p4bench_p4l.options import OPTIONS
from p4bench_p4l.peer import Peer
from p4bench_p4l.plan import PlanSettings, round_plan

PARTICIPATIONS = "count_synergies"  # per-client value: completed synergies taken part in


class P4L(Method):
    """P4L's synergy chains with accept-if-better (module docstring)."""

    name = "p4l"
    tuning_options = ("local_steps", "data_rate", "clip")  # no client sampling
    description = (
        "P4L (Arapakis et al.): Paillier-encrypted synergy chains (signed hops, beacons, retries, "
        "decryption proof), accept-if-better; secure aggregation without DP"
    )
    # no aggregator a defense could plug into: sums are formed under encryption (accept-if-better gates clients)
    capabilities = Capabilities(personalized=True, hides_individual_updates=True)
    test_metrics = ("loss", "auc")
    options = OPTIONS

    def validate_options(self) -> None:
        values, config = resolve_options(self.options, self.config.options), self.config
        if config.private:
            raise ConfigError(
                "epsilon",
                "p4l uses no differential privacy (secure aggregation only, as the paper); "
                "run it without --epsilon / --noise-multiplier",
            )
        if int(values["size_min"]) > int(values["size_max"]):
            raise ConfigError(
                "options.size_min", f"must not exceed size_max ({values['size_max']})"
            )
        if self.num_clients < 3:
            raise ConfigError("clients", "a synergy needs at least 3 peers")
        self.values = values
        self.crypto = ChainCrypto(
            str(values["crypto"]),
            int(values["key_bits"]),
            sum(v.numel() for v in self.initial_params().values()),
        )
        synergies = (
            values["synergies"]
            if values["synergies"] is not None
            else max(1, self.num_clients // 5)
        )
        self.settings = PlanSettings(
            seed=config.seed,
            num_peers=self.num_clients,
            synergies=int(synergies),
            size=int(values["size"]),
            size_min=int(values["size_min"]),
            size_max=int(values["size_max"]),
            size_law=str(values["size_dist"]),
            peer_law=str(values["sampling"]),
            retries=int(values["retries"]),
            drop_prob=float(values["drop_prob"]),
            crash_prob=float(values["crash_prob"]),
            global_timeout=values["global_timeout"],
        )
        epochs = values["epochs"]
        self.steps = (
            int(epochs) * math.ceil(1.0 / config.data_rate)
            if epochs is not None
            else config.local_steps
        )
        self.val_fraction = float(values["val_fraction"])
        self.reachable = self._proximity(str(values["proximity"]))
        self.peers: dict[int, Peer] = {}  # the peers this process holds (one on a device)

    def _proximity(self, topology: str) -> np.ndarray:
        if topology == "complete":
            return np.ones((self.num_clients, self.num_clients), dtype=bool)
        from p4bench.engine.method_kit import GraphSchedule

        return (
            GraphSchedule(topology, None, self.num_clients, self.config.seed)
            .adjacency(0)
            .astype(bool)
        )

    # -- schedule and reporting ------------------------------------------------------------
    def phases(self) -> list[Phase]:
        return [Phase("train", self.config.rounds, setup=(Exchange("keys"),))]

    def round_steps(self, phase: Phase, round_index: int) -> tuple[Step, ...]:
        ticks = [
            Exchange(f"{kind}{t}") for t in range(self.settings.ticks) for kind in ("hop", "ack")
        ]
        return (LocalUpdate(), Exchange("contribute"), *ticks, Exchange("aggregate"))

    def privacy_context(self) -> dict[str, Any]:
        """No DP; what the secure aggregation hides. `min_group`: the fewest other models in a
        sum anyone decrypts or receives (sz - 1); a chain closed early by the fallback has 3
        members, so with churn or a partial proximity graph it is 2 whatever the planned size."""
        s = self.settings
        planned = (s.largest if s.size_law == "fixed" else min(s.size_min, s.num_peers)) - 1
        faults = s.drop_prob > 0 or s.crash_prob > 0 or not bool(self.reachable.all())
        scheme = (
            f"paillier-{self.crypto.key_bits}"
            if self.crypto.name == "paillier"
            else "none (plaintext sums)"
        )
        return {
            "dp": "none",
            "secure_aggregation": scheme,
            "min_group": min(planned, 2) if faults else planned,
        }

    def derived_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return derived_metrics(totals)

    def finished(self, extra: dict[str, np.ndarray]) -> bool:
        counts = extra.get(PARTICIPATIONS)
        if counts is None or not len(counts):
            return False
        return bool(np.mean(counts >= int(self.values["mrt"])) >= float(self.values["mrr"]))

    # -- clients -------------------------------------------------------------------------
    def init_client_state(self, train: ClientTensors, ctx: StepContext) -> State:
        count = len(ctx.rows)
        with on_host():
            for node in ctx.rows.tolist():
                self.peers[node] = Peer(node, self.crypto, self.settings, self.settings.largest)
        params = replicate(self.initial_params(), count)
        return {
            "params": params,
            "split_key": ctx.rng.bits(2),
            "contribution": torch.zeros(count, vectorize(params).shape[1], dtype=torch.float64),
            PARTICIPATIONS: torch.zeros(count, dtype=torch.float64),
        }

    def _splits(self, train: ClientTensors, state: State) -> tuple[ClientTensors, ClientTensors]:
        if self.val_fraction == 0:
            return train, train
        return validation_split(train, state["split_key"], self.val_fraction)

    def local_update(
        self, state: State, train: ClientTensors, ctx: StepContext
    ) -> tuple[State, torch.Tensor]:
        fit, _ = self._splits(train, state)
        params, loss = local_sgd(ctx, state["params"], fit, self.steps, self.config.lr)
        return {**state, "params": params}, loss

    def outgoing(self, exchange: str, state: State, ctx: StepContext) -> Messages:
        rows = ctx.rows
        if exchange == "keys":
            table = {
                "vk": torch.stack(
                    [
                        torch.frombuffer(
                            bytearray(self.peers[n].signing.public_bytes), dtype=torch.uint8
                        )
                        for n in rows.tolist()
                    ]
                ).to(rows.device)
            }
            others = torch.arange(self.num_clients).unsqueeze(0) != rows.unsqueeze(1)
            sender, receiver = others.nonzero(as_tuple=True)
            return Messages(rows[sender], receiver, table, rows=sender)
        if exchange == "contribute":  # to itself: what the run's message attack may replace
            return Messages(
                rows, rows.clone(), {UPDATE_PREFIX + k: v for k, v in state["params"].items()}
            )
        if exchange.startswith("hop"):
            tick = int(exchange[3:])
            with on_host():
                tokens = [
                    (n, dst, token)
                    for n in rows.tolist()
                    for dst, token in self.peers[n].hop_outgoing(tick, self.reachable[n])
                ]
            return pack(tokens, rows.device)
        if exchange.startswith("ack"):
            with on_host():
                beacons = [
                    (n, dst, {"synergy": torch.tensor(s), "hop": torch.tensor(h)})
                    for n in rows.tolist()
                    for dst, s, h in self.peers[n].ack_outgoing()
                ]
            return pack(beacons, rows.device)
        if exchange == "aggregate":
            with on_host():
                aggregates = [
                    (n, member, payload)
                    for n in rows.tolist()
                    for members, payload in self.peers[n].aggregates()
                    for member in members
                ]
            return pack(aggregates, rows.device, share=True)
        return Messages.empty()

    def receive(self, exchange: str, state: State, inbox: Messages, ctx: StepContext) -> State:
        if exchange == "keys":
            keys = inbox.value("vk").cpu() if len(inbox) else ()
            for src, dst, vk in zip(inbox.src.tolist(), inbox.dst.tolist(), keys):
                self.peers[dst].directory[src] = bytes(vk.numpy().tobytes())
            for node in ctx.rows.tolist():
                self.peers[node].directory[node] = self.peers[node].signing.public_bytes
            return state
        if exchange == "contribute":
            return self._contribute(state, inbox, ctx)
        if exchange.startswith("hop"):
            tick = int(exchange[3:])
            with on_host():
                for src, dst, token in zip(
                    inbox.src.tolist(), inbox.dst.tolist(), host_rows(inbox)
                ):
                    self.peers[dst].hop_receive(tick, src, token)
            return state
        if exchange.startswith("ack"):
            got: dict[int, list[tuple[int, int, int]]] = {n: [] for n in ctx.rows.tolist()}
            for src, dst, s, h in (
                zip(
                    inbox.src.tolist(),
                    inbox.dst.tolist(),
                    inbox.value("synergy").tolist(),
                    inbox.value("hop").tolist(),
                )
                if len(inbox)
                else ()
            ):
                got.setdefault(dst, []).append((src, s, h))
            for node, beacons in got.items():
                if node in self.peers:
                    self.peers[node].ack_receive(beacons)
            return state
        if exchange == "aggregate":
            return self._aggregate(state, inbox, ctx)
        return state

    def _contribute(self, state: State, inbox: Messages, ctx: StepContext) -> State:
        keys = sorted(k for k in inbox.payload if k.startswith(UPDATE_PREFIX)) if len(inbox) else []
        contribution = vectorize(state["params"]).double()
        if keys:
            sent = vectorize({k[len(UPDATE_PREFIX) :]: inbox.value(k) for k in keys}).double()
            position = torch.searchsorted(ctx.rows, inbox.dst)
            contribution[position] = sent
        plans = round_plan(self.settings, ctx.round)
        host = contribution.cpu()  # the chains' cryptography works on the host
        with on_host():
            for i, node in enumerate(ctx.rows.tolist()):
                self.peers[node].new_round(plans, host[i])
        return {**state, "contribution": contribution}

    def _aggregate(self, state: State, inbox: Messages, ctx: StepContext) -> State:
        rows = ctx.rows.tolist()
        averages: list[list[torch.Tensor]] = [[] for _ in rows]
        completed: list[set[int]] = [set() for _ in rows]
        position = {node: i for i, node in enumerate(rows)}
        with on_host():
            for src, dst, payload in zip(inbox.src.tolist(), inbox.dst.tolist(), host_rows(inbox)):
                average = self.peers[dst].open_aggregate(src, payload)
                if average is not None:
                    averages[position[dst]].append(
                        average.to(ctx.rows.device)
                    )  # back to the run's device
                    completed[position[dst]].add(int(payload["synergy"]))
        assert ctx.train is not None, "the driver passes the rows' records to every step"
        _, validation = self._splits(ctx.train, state)
        params, accepted, refused = merge_candidates(
            self.model,
            state["params"],
            averages,
            validation,
            exact_scores,
            gate=bool(self.values["accept_gate"]),
            rule=str(self.values["merge"]),
        )
        for node, done in zip(rows, completed):
            peer = self.peers[node]
            peer.stats["wasted_crypto_s"] += peer.wasted(done)
            peer.stats["aggregates_received"] += len(done)
        flush_stats(ctx.metrics, [self.peers[n] for n in rows], accepted, refused)
        counts = torch.tensor([float(len(d)) for d in completed], dtype=torch.float64)
        return {**state, "params": params, PARTICIPATIONS: state[PARTICIPATIONS] + counts}

    def deployed_params(self, state: State) -> Params:
        params: Params = state["params"]
        return params

    def client_accuracies(self, state: State) -> dict[str, torch.Tensor]:
        return {PARTICIPATIONS: state[PARTICIPATIONS]}

    def write_artifacts(self, state: State, folder: Path) -> list[Path]:
        """`p4l_synergies.csv`: every synergy the peers of this process initiated and its
        outcome (the simulator holds all peers; a device launcher holds none)."""
        log = sorted(
            (row for peer in self.peers.values() for row in peer.log),
            key=lambda r: int(str(r["synergy"])),
        )
        if not log:
            return []
        path = folder / "p4l_synergies.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(log[0]))
            writer.writeheader()
            writer.writerows(log)
        return [path]
