"""Equivocation detection (`p4bench.engine.equivocation`) and the `equivocate` attack:
honest gossip is never named, an equivocator is (and its messages dropped), a lying
reporter names itself, not the sender, broadcasts are covered, and the check's exchanges
are carried and counted like the method's."""

from __future__ import annotations

import torch

from p4bench.config import RunConfig
from p4bench.engine.capabilities import Capabilities
from p4bench.engine.equivocation import EquivocationCheck, digests_exchange, signed_exchange
from p4bench.engine.messages import BROADCAST, Messages
from p4bench.engine.network import Delivery, InProcessNetwork, Network
from p4bench.engine.receive_gate import Rejections
from p4bench.engine.signed_digests import SeedKeys
from p4bench.engine.traffic import TrafficLedger
from p4bench.rng import ClientRng, node_keys
from p4bench.run.runner import run
from p4bench.testing import check_attack
from p4bench_attacks.equivocate import Equivocate, poisoned_receivers

NODES = 5


class _Identical:
    def identical_messages(self, exchange: str, phase: str, round_index: int) -> bool:
        return exchange == "gossip"


class Tampering(Network):
    """An in-process network whose deliveries of one named exchange pass through `edit`
    (what a lying peer sends, or a forged frame)."""

    def __init__(self, edit=None, exchange: str = "") -> None:
        self.inner, self.edit, self.name = InProcessNetwork(), edit, exchange
        self.inner.carry_broadcasts(NODES)
        self.exchanged: list[str] = []

    def carry_broadcasts(self, num_clients: int) -> bool:
        return True

    def exchange(self, exchange: str, phase: str, round_index: int, outgoing: Messages) -> Delivery:
        self.exchanged.append(exchange)
        delivery = self.inner.exchange(exchange, phase, round_index, outgoing)
        if exchange == self.name and self.edit is not None:
            edited = self.edit(delivery.inbox)
            return Delivery(
                edited, torch.zeros(len(edited), dtype=torch.int64), delivery.sent_sizes
            )
        return delivery


def checker(
    network: Network, mode: str = "drop", held: torch.Tensor | None = None
) -> tuple[EquivocationCheck, Rejections, TrafficLedger]:
    """The check of a process that holds `held` (default: every node)."""
    rejections, ledger = Rejections(), TrafficLedger(NODES)
    nodes = torch.arange(NODES) if held is None else held
    check = EquivocationCheck(
        _Identical(), network, rejections, SeedKeys(7), mode, nodes, NODES, True
    )
    check.begin_block(ledger)
    return check, rejections, ledger


ALL_BUT_2 = torch.tensor([0, 1, 3, 4])  # node 2 lies from a process of its own


def gossip(models: torch.Tensor) -> Messages:
    """Every node sends its model to every other node (one message per pair, as a
    gossiping method over the complete graph)."""
    src, dst = torch.meshgrid(torch.arange(NODES), torch.arange(NODES), indexing="ij")
    away = src != dst
    src, dst = src[away], dst[away]
    return Messages(src, dst, {"update.w": models[src].clone()})


def models(seed: int = 0) -> torch.Tensor:
    return torch.randn(NODES, 6, generator=torch.Generator().manual_seed(seed))


def run_check(check: EquivocationCheck, sent: Messages, exchange: str = "gossip") -> Messages:
    return check.check(exchange, "train", 0, (), sent, sent)


# -- the check on one exchange -----------------------------------------------------------
def test_honest_gossip_is_never_named_and_its_exchanges_are_counted():
    network = Tampering()
    check, rejections, ledger = checker(network)
    sent = gossip(models())
    kept = run_check(check, sent)
    assert len(kept) == len(sent) and rejections.counts == {}
    assert network.exchanged == [signed_exchange("gossip"), digests_exchange("gossip")]
    assert int(ledger.bytes_sent) > 0 and bool((ledger.received > 0).all())


def test_a_sender_of_two_models_is_named_by_every_receiver_and_dropped():
    sent = gossip(models())
    changed = (sent.src == 3) & (sent.dst >= 3)  # node 3 sends node 4 another model
    sent.table["update.w"][changed] *= -1
    check, rejections, _ = checker(Tampering())
    kept = run_check(check, sent)
    assert rejections.counts == {("equivocation", 3): NODES - 1}  # each of its messages
    assert not bool((kept.src == 3).any()) and len(kept) == len(sent) - (NODES - 1)
    # name only: counted, still delivered
    check, rejections, _ = checker(Tampering(), mode="name")
    assert len(run_check(check, sent)) == len(sent)
    assert rejections.counts == {("equivocation", 3): NODES - 1}


def with_report_of_2(reports: Messages, slot_from: Messages | None = None) -> Messages:
    """`reports` and one entry from node 2 (its process is not this one): node 1's entry on
    sender 0 (its signed digest) as node 2's, its digest and signature taken from
    `slot_from` (an earlier exchange's reports) where given, else with another digest."""

    def entry_of_1_on_0(batch: Messages) -> int:
        return int(((batch.src == 1) & (batch.table["sender"] == 0)).nonzero()[0])

    row = entry_of_1_on_0(reports)
    lie = {k: v[row : row + 1].clone() for k, v in reports.table.items()}
    if slot_from is None:
        lie["digest"][0, 0] += 1
    else:
        earlier = entry_of_1_on_0(slot_from)
        for key in ("digest", "signature"):
            lie[key][0] = slot_from.table[key][earlier]
    liar = Messages(torch.tensor([2]), torch.tensor([BROADCAST]), lie)
    return Messages.concat([reports, liar])


def test_a_lying_reporter_names_itself_never_the_honest_sender():
    sent = gossip(models())
    check, rejections, _ = checker(
        Tampering(with_report_of_2, digests_exchange("gossip")), held=ALL_BUT_2
    )
    kept = run_check(check, sent)
    assert len(kept) == len(sent)
    assert rejections.counts == {("false digest report", 2): len(ALL_BUT_2)}  # its receivers here


def test_a_signature_replayed_from_an_earlier_exchange_does_not_frame_the_sender():
    """The statement names the exchange's occurrence in the block: a reporter that keeps
    sender 0's valid signature of the first gossip and reports it in the second (where
    0 sent another model) is the one named."""
    earlier: list[Messages] = []

    def keep_then_replay(reports: Messages) -> Messages:
        if not earlier:
            earlier.append(reports)
            return reports
        return with_report_of_2(reports, slot_from=earlier[0])

    check, rejections, _ = checker(
        Tampering(keep_then_replay, digests_exchange("gossip")), held=ALL_BUT_2
    )
    run_check(check, gossip(models(0)))
    run_check(check, gossip(models(1)))
    assert rejections.counts == {("false digest report", 2): len(ALL_BUT_2)}
    # the same slot replayed within its own exchange is just the truth: nobody is named
    check, rejections, _ = checker(
        Tampering(keep_then_replay, digests_exchange("gossip")), held=ALL_BUT_2
    )
    earlier.clear()
    run_check(check, gossip(models(0)))
    assert rejections.counts == {}


def test_a_message_without_its_senders_signature_is_rejected():
    sent = gossip(models())

    def forge(signed: Messages) -> Messages:  # the signature of 1 -> 2 does not arrive intact
        table = {k: v.clone() for k, v in signed.table.items()}
        table["signature"][(signed.src == 1) & (signed.dst == 2)] ^= 1
        return Messages(signed.src, signed.dst, table)

    check, rejections, _ = checker(Tampering(forge, signed_exchange("gossip")))
    kept = run_check(check, sent)
    assert rejections.counts == {("unsigned message", 1): 1}
    assert len(kept) == len(sent) - 1 and not bool(((kept.src == 1) & (kept.dst == 2)).any())


def test_broadcasts_are_covered():
    values = models()
    honest = Messages(torch.arange(NODES), torch.full((NODES,), BROADCAST), {"update.w": values})
    check, rejections, _ = checker(Tampering())
    assert len(run_check(check, honest)) == len(honest) and rejections.counts == {}
    # node 0's broadcast, as sent on a wire (one copy per receiver), with one copy changed
    wide = honest.expand_broadcasts(NODES)
    table = {"update.w": wide.value("update.w").clone()}
    table["update.w"][(wide.src == 0) & (wide.dst == NODES - 1)] += 1.0
    check, rejections, _ = checker(Tampering())
    kept = run_check(check, Messages(wide.src, wide.dst, table))
    assert rejections.counts == {("equivocation", 0): NODES - 1}
    assert not bool((kept.src == 0).any())


def test_undeclared_exchanges_are_not_checked():
    network = Tampering()
    check, _, _ = checker(network)
    assert check.covered_keys("gradients", "train", 0) is None
    assert check.covered_keys("gossip", "train", 0) == ()
    assert checker(network, mode="none")[0].covered_keys("gossip", "train", 0) is None


# -- the attack -------------------------------------------------------------------------------
def test_equivocate_sends_each_attacker_two_models():
    sent = gossip(models())
    mine = sent.select(sent.src < 2)
    attack = Equivocate(RunConfig(options={"equivocate_fraction": 0.5}), 10)
    out = attack.tamper("gossip", mine, ClientRng(node_keys(0, mine.src, 2)))
    honest = models()[mine.src]
    flipped = poisoned_receivers(mine, 0.5)
    assert torch.equal(out.value("update.w")[flipped], -honest[flipped])
    assert torch.equal(out.value("update.w")[~flipped], honest[~flipped])
    for sender in (0, 1):  # two of its four receivers each
        assert int(flipped[mine.src == sender].sum()) == 2
    alone = mine.select((mine.src == 0) & (mine.dst == 1))  # one receiver: nothing to equivocate
    assert not bool(poisoned_receivers(alone, 0.5).any())
    assert Equivocate.incompatibility(Capabilities(uses_server=True)) is not None
    one = mine.select((mine.src == 0) & (mine.dst <= 2))  # two receivers, any fraction in (0, 1)
    assert (
        int(poisoned_receivers(one, 0.01).sum()) == 1
        and int(poisoned_receivers(one, 0.99).sum()) == 1
    )


# -- whole runs -------------------------------------------------------------------------------
def rejections_of(result) -> dict[str, float]:
    out: dict[str, float] = {}
    for report in result.outcome.reports:
        for key, value in report.metrics.items():
            if key.startswith("rejected "):
                out[key] = out.get(key, 0.0) + value
    return out


def test_dp_dsgd_names_the_equivocators_and_honest_runs_name_nobody(small_config):
    base = dict(method="dp-dsgd", clients=8, rounds=2, local_steps=1)
    ring = {"topology": "ring"}
    clean = run(small_config(**base, options=ring), track=False, verify=False)
    unchecked = run(
        small_config(**base, options={**ring, "equivocation": "none"}), track=False, verify=False
    )
    assert rejections_of(clean) == {}
    # the check's exchanges are carried and counted
    assert clean.outcome.bytes_sent > unchecked.outcome.bytes_sent
    chosen: list[torch.Tensor] = []
    attacked = dict(base, attack="equivocate", malicious_fraction=0.25)
    result = run(
        small_config(**attacked, options=ring),
        track=False,
        verify=False,
        on_prepared=lambda prepared: chosen.append(prepared.job.malicious.clone()),
    )
    malicious = chosen[0].nonzero().squeeze(1).tolist()
    named = rejections_of(result)
    # each attacker, once per message to its two ring neighbours in each of the 2 gossips
    assert named == {f"rejected equivocation from {m}": 4.0 for m in malicious}
    named_only = run(
        small_config(**attacked, options={**ring, "equivocation": "name"}),
        track=False,
        verify=False,
    )
    assert rejections_of(named_only) == named
    dropped, kept = result.outcome.final_params, named_only.outcome.final_params
    assert any(not torch.equal(dropped[k], kept[k]) for k in dropped)


def test_equivocate_conforms_in_every_runtime():
    """The conformance kit: the attacked dp-dsgd run is the same in the simulator, the
    reference and bytes runtimes and on an accelerator, with the check's exchanges."""
    check_attack("equivocate")
