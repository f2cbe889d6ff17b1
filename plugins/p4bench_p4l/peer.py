"""One P4L peer's side of the synergy protocol (spec section 1.3), over logical ticks.

A tick is the hop timeout t_p. In tick t every holder sends its token (exchange
`hop<t>`), and every peer that took a token answers its sender with a beacon
(`ack<t>`); a sender without a beacon retries in tick t + 1 with another peer (the
same initiator for a final message), at most R times, then falls back to sending the
final message to the initiator when the chain has at least 3 members, else aborts. The
initiator discards a final message after the synergy's deadline. After the last tick
every initiator holding a final message decrypts, proves the decryption and sends the
average to the members (`aggregate`).

Tokens are flat dicts of tensors (one message's payload), signed by their sender with
Ed25519 over every field but the signature; the sender's verification key travels with
it (erratum A2) and must match the key the sender announced at setup. Nothing here is
pickled: on devices the tokens cross TLS as safetensors frames like any message.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from p4bench_p4l.chain_crypto import ChainCrypto
from p4bench_p4l.plan import PlanSettings, SynergyPlan, choose_successor, dropped
from p4bench_p4l.signing import SigningKeys, verify

FINAL_PREFIX = "final."  # an aggregate carries the final token it decrypted, fields prefixed


def _scalar(value: int | float, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def members_of(token: dict[str, torch.Tensor]) -> list[int]:
    """The ordered member list L (the initiator first)."""
    members = token["members"]
    return [int(m) for m in members[members >= 0]]


def signed_fields(payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in payload.items() if k != "sig"}


@dataclass
class Outbound:
    """A token this peer forwards: to whom, who was tried for this hop, retries used."""

    token: dict[str, torch.Tensor]
    target: int | None = None
    tried: set[int] = field(default_factory=set)
    retries: int = 0


@dataclass
class Initiated:
    plan: SynergyPlan
    final: dict[str, torch.Tensor] | None = None


class Peer:
    """Protocol state of one peer: its keys (process-local: never in the run state, which
    devices report to the launcher) and the tokens in flight this round."""

    def __init__(
        self, node: int, crypto: ChainCrypto, settings: PlanSettings, size_max: int
    ) -> None:
        self.node, self.crypto, self.settings, self.size_max = node, crypto, settings, size_max
        self.signing = SigningKeys.generate()
        self.keys = crypto.keypair()
        self.directory: dict[int, bytes] = {}  # verification keys announced at setup
        self.stats: dict[str, float] = defaultdict(float)  # counts and seconds, flushed every round
        self.log: list[dict[str, object]] = []  # one row per synergy initiated here (artifact)
        self.new_round([], torch.zeros(0))

    # -- round bookkeeping -------------------------------------------------------------
    def new_round(self, plans: list[SynergyPlan], contribution: torch.Tensor) -> None:
        self.contribution = contribution.double()
        self.plans = [p for p in plans if p.initiator == self.node]
        self.down = any(p.crash for p in self.plans)  # a crashed initiator is gone for the round
        self.outbox: list[Outbound] = []  # to send in the next hop tick
        self.waiting: list[Outbound] = []  # sent this tick, beacon expected
        self.beacons: list[tuple[int, int, int]] = []  # (to, synergy, hop)
        self.initiated = {p.id: Initiated(p) for p in self.plans}
        self.joined: dict[int, float] = {}  # synergy -> crypto seconds this peer spent on it

    def _sign(self, token: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        token = {
            **token,
            "vk": torch.frombuffer(bytearray(self.signing.public_bytes), dtype=torch.uint8),
        }
        token["sig"] = torch.frombuffer(
            bytearray(self.signing.sign(signed_fields(token))), dtype=torch.uint8
        )
        return token

    def authentic(self, src: int, payload: dict[str, torch.Tensor], prefix: str = "") -> bool:
        """The payload (or its `prefix`ed part) is signed by the key `src` announced."""
        fields = (
            {k[len(prefix) :]: v for k, v in payload.items() if k.startswith(prefix)}
            if prefix
            else payload
        )
        known = self.directory.get(src)
        vk, sig = fields.get("vk"), fields.get("sig")
        if known is None or vk is None or sig is None or bytes(vk.numpy().tobytes()) != known:
            return False
        return verify(known, signed_fields(fields), bytes(sig.numpy().tobytes()))

    # -- hop ticks ---------------------------------------------------------------------
    def hop_outgoing(
        self, tick: int, reachable: np.ndarray
    ) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Tokens sent in `tick`: new synergies (tick 0), forwards, retries and fallbacks."""
        if tick == 0:
            for plan in self.plans:
                self.outbox.append(Outbound(self._initial_token(plan)))
        sent = []
        for item in self.outbox:
            target = self._next_target(item, tick, reachable)
            if target is None:
                continue
            item.target = target
            item.tried.add(target)
            sent.append((target, item.token))
            self.waiting.append(item)
        self.outbox = []
        if tick == 0 and self.down:  # the initiator crashes right after sending its token
            self.waiting = []
        return sent

    def _initial_token(self, plan: SynergyPlan) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        encrypted = self.crypto.encrypt(self.crypto.public_tensor(self.keys), self.contribution)
        members = torch.full((self.size_max,), -1, dtype=torch.int64)
        members[0] = self.node
        token = self._sign(
            {
                "synergy": _scalar(plan.id),
                "slots": _scalar(plan.size - 1),
                "members": members,
                "time": _scalar(time.time(), torch.float64),
                "final": _scalar(0),
                "pk": self.crypto.public_tensor(self.keys),
                "sum": encrypted,
            }
        )
        self._spent(plan.id, time.perf_counter() - started)
        return token

    def _next_target(self, item: Outbound, tick: int, reachable: np.ndarray) -> int | None:
        """Where the token goes now, converting it to a final message (fallback) when the
        retries are used up and the chain is long enough; None: it is given up."""
        members = members_of(item.token)
        synergy = int(item.token["synergy"])
        if item.retries > self.settings.retries:
            if bool(item.token["final"]) or len(members) < 3:  # a synergy of 2 is not allowed
                self.stats["aborted_chains"] += 1
                return None
            self.stats["fallbacks"] += 1
            item.token = self._sign(
                {**signed_fields(item.token), "final": _scalar(1), "slots": _scalar(0)}
            )
            item.retries, item.tried = 0, set()
        if bool(item.token["final"]):
            return members[0]
        hop = len(members)
        target = choose_successor(
            self.settings,
            synergy,
            hop,
            item.retries,
            self.node,
            set(members) | item.tried,
            reachable,
        )
        if target is None:  # nobody left in reach: as if every retry had failed
            item.retries = self.settings.retries + 1
            return self._next_target(item, tick, reachable)
        return target

    def hop_receive(self, tick: int, src: int, token: dict[str, torch.Tensor]) -> None:
        """A token from `src` in `tick`: take it (add the own encrypted model, sign) or not."""
        synergy = int(token["synergy"])
        if self.down or dropped(self.settings, synergy, tick, self.node):
            self.stats["dropped_hops"] += 1
            return
        if not self.authentic(src, token):
            self.stats["bad_signatures"] += 1
            return
        members = members_of(token)
        if bool(token["final"]):
            started = self.initiated.get(synergy)
            if started is None or members[0] != self.node or tick >= started.plan.deadline:
                self.stats["late_or_foreign_finals"] += 1
                return
            started.final = token
            self.beacons.append((src, synergy, len(members)))
            return
        if self.node in members or int(token["slots"]) <= 0:  # no return; nothing left to fill
            self.stats["refused_tokens"] += 1
            return
        self._record_hop(token)
        began = time.perf_counter()
        added = self.crypto.add(token["pk"], token["sum"], self.contribution)
        extended = token["members"].clone()
        extended[len(members)] = self.node
        slots = int(token["slots"]) - 1
        forwarded = self._sign(
            {
                **signed_fields(token),
                "sum": added,
                "members": extended,
                "slots": _scalar(slots),
                "final": _scalar(int(slots == 0)),
                "time": _scalar(time.time(), torch.float64),
            }
        )
        seconds = time.perf_counter() - began
        self._spent(synergy, seconds)
        self.stats["hop_crypto_s"] += seconds
        self.outbox.append(Outbound(forwarded))
        self.beacons.append((src, synergy, len(members)))

    def _record_hop(self, token: dict[str, torch.Tensor]) -> None:
        self.stats["hops"] += 1
        self.stats["hop_bytes"] += sum(v.numel() * v.element_size() for v in token.values())
        self.stats["hop_transfer_s"] += max(0.0, time.time() - float(token["time"]))

    def _spent(self, synergy: int, seconds: float) -> None:
        self.joined[synergy] = self.joined.get(synergy, 0.0) + seconds
        self.stats["crypto_s"] += seconds

    def ack_outgoing(self) -> list[tuple[int, int, int]]:
        beacons, self.beacons = self.beacons, []
        return beacons

    def ack_receive(self, beacons: list[tuple[int, int, int]]) -> None:
        """Beacons (src, synergy, hop): confirmed sends are done, the others retry next tick."""
        confirmed = set(beacons)
        for item in self.waiting:
            if (item.target, int(item.token["synergy"]), len(members_of(item.token))) in confirmed:
                continue
            item.retries += 1
            self.stats["retries"] += 1
            self.outbox.append(item)
        self.waiting = []

    # -- the aggregate -----------------------------------------------------------------
    def aggregates(self) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
        """(members, signed aggregate) of every synergy this peer initiated and can close."""
        out = []
        for synergy, started in self.initiated.items():
            self.stats["synergies"] += 1
            plan, final = started.plan, started.final
            outcome = "crashed" if plan.crash else "timeout" if final is None else "completed"
            self.log.append(
                {
                    "round": synergy // 10_000,
                    "synergy": synergy,
                    "initiator": self.node,
                    "size": plan.size,
                    "outcome": outcome,
                    "members": " ".join(map(str, members_of(final))) if final else "",
                }
            )
            self.stats[outcome] += 1
            if final is None or plan.crash:
                continue
            members = members_of(final)
            began = time.perf_counter()
            plain, randomness = self.crypto.open(self.keys, final["sum"])
            payload = {FINAL_PREFIX + k: v for k, v in final.items()}
            payload.update(
                {
                    "synergy": _scalar(synergy),
                    "count": _scalar(len(members)),
                    "plain": plain,
                    "rand": randomness,
                }
            )
            out.append((members, self._sign(payload)))
            self._spent(synergy, time.perf_counter() - began)
            self.stats["members"] += len(members)
        return out

    def open_aggregate(self, src: int, payload: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The verified average of an aggregate from initiator `src`, or None (rejected):
        the initiator's signature, the last member's signature on the final token, this
        peer among the members, and the decryption proof against the signed ciphertexts."""
        final = {
            k[len(FINAL_PREFIX) :]: v for k, v in payload.items() if k.startswith(FINAL_PREFIX)
        }
        members = members_of(final) if "members" in final else []
        if (
            not members
            or members[0] != src
            or self.node not in members
            or int(payload["count"]) != len(members)
        ):
            self.stats["bad_aggregates"] += 1
            return None
        if src != self.node and not (
            self.authentic(src, payload) and self.authentic(members[-1], payload, FINAL_PREFIX)
        ):
            self.stats["bad_signatures"] += 1
            return None
        began = time.perf_counter()
        if src == self.node:  # its own decryption
            total: torch.Tensor | None = self.crypto.decode(self.keys, payload["plain"])
        else:
            total = self.crypto.verify(final["pk"], final["sum"], payload["plain"], payload["rand"])
        self._spent(int(payload["synergy"]), time.perf_counter() - began)
        if total is None:
            self.stats["bad_proofs"] += 1
            return None
        return total / len(members)

    def wasted(self, completed: set[int]) -> float:
        """Crypto seconds this round spent on synergies that never delivered an aggregate here."""
        return sum(seconds for synergy, seconds in self.joined.items() if synergy not in completed)
