"""The method-level audit's observer: every message a client sends, as its neighbours
(or the server) receive it, scored for the client's canary records.

The run's network is wrapped (`p4bench.engine.network.ObservedNetwork`) to hand each
exchange's outgoing messages to `MessageScores` before delivering them unchanged. For canary (i, k) with marker
column j and label c, a message from client i that carries the model (or an update or
gradient of it) adds W[c, j] - ref to the canary's score, ref the mean of W[:, j] over
the other classes (add-remove) or W[c', j] (replace-one). Only client i's own records
touch column j, so an included canary moves it: summed over client i's messages, the
score grows with every sampled step the canary went into, and with anything else the
method lets the record leak into what it sends.

Payloads: ``update.<name>`` or ``model.<name>`` entries named like the model's
parameters (one model or update per message: a P4 lead's group model is read like a
member's proxy), or ``update.*`` entries that each hold a whole flattened model
(P values: PDSL's ``update.model`` and ``update.gradient``, P2P-FL's ``update.params``).
An entry named ``*gradient*`` is a gradient: the model moves against it, so it counts
negatively. Other payloads are refused (IncompatibleError): the audit does not guess.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from p4bench.engine.messages import MODEL_PREFIX, UPDATE_PREFIX, Messages, prefixed_keys
from p4bench.errors import IncompatibleError

__all__ = ["MessageScores", "canary_values"]

PREFIXES = (
    UPDATE_PREFIX,
    MODEL_PREFIX,
)  # a model, update or gradient (`update.*`), a model to use as is (`model.*`)


def canary_values(
    vectors: torch.Tensor, own: torch.Tensor, reference: torch.Tensor
) -> torch.Tensor:
    """(n, m) W[c, j] - ref of each row's canaries: `vectors` (n, P) flat models,
    `own` (n, m) and `reference` (n, m, R) flat indices."""
    values = vectors.to(torch.float64)
    picked = torch.gather(values, 1, own)
    refs = torch.gather(values, 1, reference.reshape(len(values), -1)).reshape(reference.shape)
    return picked - refs.mean(dim=2)


class MessageScores:
    """Per-canary scores summed over the messages each client sends (not to itself)."""

    def __init__(
        self, own: np.ndarray, reference: np.ndarray, params: Mapping[str, torch.Tensor]
    ) -> None:
        self.own = torch.from_numpy(own)  # (M, m)
        self.reference = torch.from_numpy(reference)  # (M, m, R)
        self.names = sorted(params)
        self.size = sum(int(v.numel()) for v in params.values())
        self.shapes = {k: tuple(v.shape) for k, v in params.items()}
        self.scores = torch.zeros(self.own.shape, dtype=torch.float64)
        self.messages = torch.zeros(
            self.own.shape[0], dtype=torch.int64
        )  # scored messages per client
        self.kinds: set[str] = set()

    def _vectors(
        self, payload: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, float, str]]:
        """(n, P) flat models of the payload, each with its sign and a description."""
        found = []
        for prefix in PREFIXES:
            found += self._prefixed(payload, prefix)
        return found

    def _prefixed(
        self, payload: Mapping[str, torch.Tensor], prefix: str
    ) -> list[tuple[torch.Tensor, float, str]]:
        keys = prefixed_keys(payload, prefix)
        names = [k[len(prefix) :] for k in keys]
        if sorted(names) == self.names:
            parts = [
                payload[prefix + name].reshape(len(payload[prefix + name]), -1)
                for name in self.names
            ]
            return [(torch.cat(parts, dim=1), 1.0, "parameters")]
        found = []
        for key in keys:
            value = payload[key]
            width = value[0].numel() if len(value) else 0
            if width != self.size:
                raise IncompatibleError(
                    f"the method-level audit reads models, updates or gradients from messages; payload entry '{key}' "
                    f"holds {width} values per message, the model has {self.size} parameters ({', '.join(self.names)})"
                )
            gradient = "gradient" in key[len(prefix) :]
            found.append(
                (
                    value.reshape(len(value), -1),
                    -1.0 if gradient else 1.0,
                    "gradients" if gradient else "models",
                )
            )
        return found

    def add(self, messages: Messages) -> None:
        """Score the messages clients send to others (the server's own are not a client's)."""
        if not len(messages):
            return
        src, dst = messages.src.cpu(), messages.dst.cpu()
        chosen = (src >= 0) & (src != dst) & (src < len(self.own))
        if not bool(chosen.any()):
            return
        if not any(prefixed_keys(messages.table, prefix) for prefix in PREFIXES):
            return  # control messages (selections, announcements): no model in them
        picked = messages.select(chosen.nonzero().squeeze(1).to(messages.src.device))
        senders = src[chosen]
        for vectors, sign, kind in self._vectors(picked.payload):
            values = canary_values(
                vectors.detach().cpu(), self.own[senders], self.reference[senders]
            )
            self.scores.index_add_(0, senders, sign * values)
            self.kinds.add(kind)
        self.messages.index_add_(0, senders, torch.ones_like(senders))
