"""How the round driver applies the run's attack: poisoned labels of the malicious clients,
and their tampered update messages (with what omniscient attackers may know)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from p4bench.engine.messages import UPDATE_PREFIX, Messages
from p4bench.engine.state import vectorize
from p4bench.engine.threats import Attack
from p4bench.models import Params
from p4bench.rng import ClientRng

__all__ = ["attacker_knowledge", "carries_updates", "poison", "tamper"]


def poison(
    attack: Attack, labels: torch.Tensor, bad: torch.Tensor, attack_rng: ClientRng
) -> torch.Tensor:
    """`labels` (C, n) with the malicious rows `bad` poisoned. Attacks with
    `random_poisoning` draw from those clients' own attack streams, so a client's labels
    do not depend on which clients share its group (the same in every runtime)."""
    poisoned = labels.clone()
    if attack.random_poisoning:
        rng = attack_rng.take(bad)
        poisoned[bad] = attack.poison_labels(labels[bad], rng=rng)  # type: ignore[call-arg]
        attack_rng.put(bad, rng)
    else:
        poisoned[bad] = attack.poison_labels(labels[bad])
    return poisoned


def carries_updates(messages: Messages) -> bool:
    """Whether the messages hold model updates (`update.*` keys), what attacks act on."""
    return len(messages) > 0 and any(
        k.startswith(UPDATE_PREFIX) for k in messages.table
    )  # keys: no gather


def attacker_knowledge(
    outgoing: list[Messages], is_malicious: Callable[[Messages], torch.Tensor]
) -> list[dict[str, Messages]]:
    """Per group, what omniscient attackers know besides their own messages: `observed`,
    the benign update messages of the exchange, and `colluding`, the honest messages
    of the malicious clients held by other groups."""
    benign = Messages.concat([m.select(~is_malicious(m)) for m in outgoing if carries_updates(m)])
    attackers = [
        m.select(is_malicious(m)) if carries_updates(m) else Messages.empty() for m in outgoing
    ]
    return [
        {
            "observed": benign,
            "colluding": Messages.concat([a for j, a in enumerate(attackers) if j != i]),
        }
        for i in range(len(outgoing))
    ]


def tamper(
    attack: Attack,
    exchange: str,
    rows: torch.Tensor,
    attack_rng: ClientRng,
    messages: Messages,
    bad: torch.Tensor,
    reference: Params | None,
    observed: Messages | None = None,
    colluding: Messages | None = None,
) -> Messages:
    """The group's outgoing `messages` with those of its malicious senders (`bad`) as the
    attack sends them; the attack draws from those clients' own attack streams."""
    if not bool(bad.any()) or not (carries_updates(messages) or attack.tampers_models):
        return messages  # attacks act on model updates only, unless they say otherwise
    index = bad.nonzero().squeeze(1)
    position = torch.searchsorted(rows, messages.src[index])
    rng = attack_rng.take(position)
    base = vectorize(reference)[position] if reference is not None else None
    known = (
        {}
        if observed is None
        else {
            "observed": observed,
            "colluding": colluding if colluding is not None else Messages.empty(),
        }
    )
    tampered = attack.tamper(exchange, messages.select(index), rng, base, **known)
    attack_rng.put(position, rng)
    if len(tampered) != len(
        index
    ):  # the attack sends more (or fewer) messages than the honest clients would
        if not bool(torch.isin(tampered.src, messages.src[index]).all()):
            raise ValueError(f"attack '{attack.name}' sent as a client it does not control")
        return Messages.concat([messages.select(~bad), tampered])
    payload = {k: v.clone() for k, v in messages.payload.items()}
    for key, value in tampered.payload.items():
        payload[key][index] = value.to(payload[key].dtype)
    return Messages(messages.src, messages.dst, payload)
