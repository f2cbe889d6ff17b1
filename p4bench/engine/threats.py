"""Attack and defense plugin bases, and the aggregation point where defenses act.

Attacks act on a malicious client's training labels (before training) or on the
messages it sends (after `Method.outgoing`). Payload entries named ``update.*`` are the
model or model update a message carries: that is what message attacks replace and what
defenses inspect. Defenses never learn which clients are malicious (except the `ideal`
oracle, to which the harness reveals them).

Omniscient attacks (ALIE, IPM, min-max, ...) also see the honest updates of the same
exchange that the runtime holds: all of them in the batched simulator and the
in-process reference runtimes, none where each node runs in its own process. That
knowledge is a simulation assumption of the robustness literature, not something a
deployed attacker has; such attacks fall back to the malicious clients' own updates.
"""

from __future__ import annotations

import inspect
from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from p4bench.engine.messages import Messages, update_keys
from p4bench.engine.screen import finite_rows, screened
from p4bench.moved import forward_moved
from p4bench.options import Option, resolve_options
from p4bench.rng import ClientRng

# defined with the messages; imported from here before 0.2
__getattr__ = forward_moved(__name__, {"UPDATE_PREFIX": "p4bench.engine.messages"})

if TYPE_CHECKING:
    from p4bench.config import RunConfig
    from p4bench.engine.capabilities import Capabilities

TIMINGS = ("after-grouping", "before-grouping")


def update_vectors(payload: dict[str, torch.Tensor]) -> torch.Tensor:
    """(n, P): the ``update.*`` entries of each message flattened in key order."""
    keys = update_keys(payload)
    return torch.cat([payload[k].flatten(start_dim=1) for k in keys], dim=1)


def with_update_vectors(
    payload: dict[str, torch.Tensor], vectors: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A copy of `payload` whose ``update.*`` entries are taken from `vectors` (n, P)."""
    out, offset = dict(payload), 0
    for key in update_keys(payload):
        shape = payload[key].shape
        size = int(torch.Size(shape[1:]).numel())
        out[key] = vectors[:, offset : offset + size].reshape(shape).to(payload[key].dtype)
        offset += size
    return out


class Attack(ABC):
    """Base class of attack plugins. Override `poison_labels` or `tamper` (or both).

    Subclasses extend `options` (`Attack.options + (Option(...),)`); the constructor
    resolves them into `self.option_values`.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    needs_individual_updates: ClassVar[bool] = False
    options: ClassVar[tuple[Option, ...]] = (
        Option(
            "attack_timing",
            str,
            "after-grouping",
            "phases message attacks act in: after-grouping skips a "
            "method's grouping phase (P4's phase 1), before-grouping acts in it too",
            choices=TIMINGS,
        ),
    )
    omniscient: ClassVar[bool] = False  # True: `tamper` also gets `observed` and `colluding`
    # True: `poison_labels` also gets keyword `rng`, the malicious clients' attack streams
    # (seeded by run seed and client id), so random poisoning is the same in every runtime.
    random_poisoning: ClassVar[bool] = False
    # True: `tamper` also gets the messages that carry no ``update.*`` entries (e.g. the
    # ``model.*`` a P4 aggregator distributes); False: only model updates reach it.
    tampers_models: ClassVar[bool] = False

    def __init__(self, config: RunConfig, num_classes: int) -> None:
        self.config = config
        self.num_classes = num_classes
        self.option_values = resolve_options(self.options, config.options)
        self.timing = self.option_values["attack_timing"]

    @classmethod
    def incompatibility(cls, capabilities: Capabilities) -> str | None:
        """Why this attack cannot target a method with these capabilities, or None.
        Message attacks need a method whose clients send model updates."""
        sends_updates = (
            capabilities.shares_individual_updates
            or capabilities.has_aggregator
            or capabilities.hides_individual_updates
        )  # sent, but only inside encrypted sums
        if cls.tamper is not Attack.tamper and not sends_updates:
            return "it tampers with the model updates clients send, and this method sends none"
        return None

    def acts_in(self, phase: str) -> bool:
        """Whether message attacks are active in `phase`. Methods with a grouping phase
        name it "grouping"; option attack_timing = before-grouping | after-grouping (default)."""
        return phase != "grouping" or self.timing == "before-grouping"

    def poison_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels (C, n) of malicious clients -> the labels they train on (entries outside
        [0, L) are padding). With `random_poisoning` it is also called with `rng`, one row
        per client."""
        return labels

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        """Messages sent by malicious clients (one rng row per message) -> what is actually sent.

        `reference` (n, P) is the model each ``update.*`` payload is a delta from (the
        current global or group model), or None when the payload is a model itself.
        Attacks with `omniscient = True` are also called with keywords `observed`, the
        benign messages of the same exchange that the runtime holds, and `colluding`, the
        honest messages of the other malicious clients it holds (either possibly empty).
        """
        return messages


class ModelReplacementAttack(Attack):
    """Base for attacks that replace the model a malicious client sends (byzantine
    attacks in the paper's threat model): override `replace(model, honest, rng)`."""

    def replace(
        self, honest_model: torch.Tensor, global_model: torch.Tensor, rng: ClientRng
    ) -> torch.Tensor:
        raise NotImplementedError

    def tamper(
        self,
        exchange: str,
        messages: Messages,
        rng: ClientRng,
        reference: torch.Tensor | None = None,
    ) -> Messages:
        updates = update_vectors(messages.payload)
        base = torch.zeros_like(updates) if reference is None else reference.to(updates.dtype)
        honest_model = base + updates if reference is not None else updates
        model = self.replace(honest_model, base, rng)
        sent = model - base if reference is not None else model
        return Messages(messages.src, messages.dst, with_update_vectors(messages.payload, sent))


class Defense(ABC):
    """Base class of defense plugins: choose which updates to trust at aggregation points.

    Batched over aggregation points: `updates` (B, n, P) holds the updates each of B
    receivers got (padded; `mask` (B, n) marks real ones), so every group of a P2P
    method is defended in one call.

    Every subclass's `select` and `aggregate` run behind the shared screen
    (`p4bench.engine.screen`): updates with a non-finite entry or a non-finite or
    negative weight, and a sender's repeated updates (where `senders` is given), are
    masked out before the rule sees them and reported dropped; a receiver left with no
    usable update gets the zero aggregate. Rules need not check for NaN themselves.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    needs_individual_updates: ClassVar[bool] = True
    options: ClassVar[
        tuple[Option, ...]
    ] = ()  # declared config.options keys, resolved into `option_values`
    # drops updates by its rule (so detection precision/recall apply); the shared screen
    # drops non-finite and repeated updates for every defense, filtering or not
    filters: ClassVar[bool] = True
    # True: `select`/`aggregate` get keywords receivers (B,) and senders (B, n) (-1 =
    # padding): the node ids a receiver always knows, for defenses with per-peer memory.
    uses_identities: ClassVar[bool] = False
    needs_oracle: ClassVar[bool] = False  # True only for the harness's ideal defense
    # True: a client-side gate. After every `receive` that changes a client's deployed model,
    # the driver asks `accept(new, old)` with both models' accuracies on the client's own
    # training records and keeps the client's previous state where it refuses.
    gates_clients: ClassVar[bool] = False

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.option_values = resolve_options(self.options, config.options)

    def __init_subclass__(cls, **kwargs: object) -> None:
        # every rule a subclass defines runs behind the screen: the guarantees hold for
        # third-party defenses too, with no change to the plugin interface
        super().__init_subclass__(**kwargs)
        for name in ("select", "aggregate"):
            rule = cls.__dict__.get(name)
            if inspect.isfunction(rule):
                setattr(cls, name, screened(rule))

    def reveal_malicious(self, malicious: torch.Tensor) -> None:
        """Harness only, for defenses with `needs_oracle`: the (M,) malicious mask."""
        raise NotImplementedError

    @classmethod
    def incompatibility(cls, capabilities: Capabilities) -> str | None:
        """Why this defense cannot protect a method with these capabilities, or None."""
        if cls.needs_individual_updates and capabilities.hides_individual_updates:
            return (
                "it inspects individual updates, and this method only ever exposes running sums of them "
                "(secure aggregation, e.g. p4l's synergy chain: Paillier-encrypted, or the same sums in plaintext "
                "with -o crypto=plaintext); accept-if-better runs on each client and works on the sums"
            )
        if cls.needs_individual_updates and not (
            capabilities.has_aggregator and capabilities.shares_individual_updates
        ):
            return "it filters individual updates at an aggregation point, and this method aggregates none"
        return None

    @classmethod
    def uncertified_steps(cls) -> list[str]:
        """Reasons a private run's epsilon would not hold with this defense: a step that
        reads clients' records outside the ledger (a client gate does). Empty for defenses
        that only see what was released."""
        if cls.gates_clients:
            return [
                f"defense {cls.name}: the gate's decision reads each client's own records outside the ledger "
                "(not a DP release), and it chooses the model the client trains on and sends next"
            ]
        return []

    def accept(self, new_accuracy: torch.Tensor, old_accuracy: torch.Tensor) -> torch.Tensor:
        """(C,) bool, gates only: keep the received model (default: it scores at least as well)."""
        return new_accuracy >= old_accuracy

    @screened
    def select(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> torch.Tensor:
        """(B, n) bool: which updates to keep. Default keeps all real (screened) ones."""
        return mask

    @screened
    def aggregate(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        **identities: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aggregate (B, P), kept (B, n)): the weighted mean of the selected updates
        (zeros, nothing kept, for a receiver without a usable update)."""
        kept = self.select(updates, weights, mask, **identities) & mask
        kept = torch.where(
            kept.any(dim=1, keepdim=True), kept, mask
        )  # never drop every usable update
        return weighted_mean(updates, weights * kept), kept


def weighted_mean(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, P) mean of updates (B, n, P) with weights (B, n) (zero weight = ignored).

    Never non-finite because of one bad input: an update with a non-finite entry, and a
    non-finite or negative weight, count as weight 0; a row with no positive weight
    gives zeros. The weights are normalised before the product, so a large finite
    update is never multiplied by a sample count (float32 overflow)."""
    w = weights.to(updates.dtype)
    w = torch.where(torch.isfinite(w) & (w > 0), w, torch.zeros((), dtype=w.dtype, device=w.device))
    mean = _normalised_product(updates, w)
    if bool(torch.isfinite(mean).all()):  # the usual case: one pass over the updates
        return mean
    # a non-finite entry spoils its coordinates whatever its weight (0 * NaN = NaN):
    # only then find those rows, zero them and take the product again
    finite = finite_rows(updates)
    w = torch.where(finite, w, torch.zeros((), dtype=w.dtype, device=w.device))
    return _normalised_product(updates.masked_fill(~finite.unsqueeze(-1), 0), w)


def _normalised_product(updates: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    share = w / w.sum(dim=1, keepdim=True).clamp_min(1e-12)
    # a batched matrix-vector product: no (B, n, P) temporary
    return torch.bmm(share.unsqueeze(1), updates).squeeze(1)


def pad_by_destination(
    inbox: Messages, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group `inbox` (sorted by destination) into (dst (B,), updates (B, n, P), weights
    (B, n), mask (B, n), src (B, n), -1 where padded)."""
    updates = update_vectors(inbox.payload)
    dst, counts = torch.unique_consecutive(inbox.dst, return_counts=True)
    width = (
        int(counts.max()) if len(counts) else 0
    )  # the one read back to the host (the padded shape)
    total = len(inbox)  # = counts.sum(), known on the host: repeat_interleave need not read it back
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(total) - torch.repeat_interleave(starts, counts, output_size=total)
    row = torch.repeat_interleave(torch.arange(len(dst)), counts, output_size=total)
    if (
        width * len(dst) == total
    ):  # every receiver got as many (none above width): already (B, n, P) in order
        padded = updates.view(len(dst), width, updates.shape[1])
    else:
        padded = updates.new_zeros(len(dst), width, updates.shape[1])
        padded[row, slot] = updates
    w = torch.zeros(len(dst), width, dtype=torch.float64)
    w[row, slot] = weights.double()
    mask = torch.zeros(len(dst), width, dtype=torch.bool)
    mask[row, slot] = True
    src = torch.full((len(dst), width), -1, dtype=torch.int64)
    src[row, slot] = inbox.src
    return dst, padded, w, mask, src


@dataclass
class Aggregator:
    """The place where received updates are combined; the run's defense plugs in here.

    `log` records, per aggregation, which senders' updates were kept and which dropped
    (the harness, not the defense, uses this to score detection).
    """

    defense: Defense | None = None
    log: list[tuple[int, list[int], list[int]]] = field(default_factory=list)

    def aggregate(
        self, inbox: Messages, weights: torch.Tensor, round_index: int = -1
    ) -> torch.Tensor:
        """(P,) combination of all ``update.*`` vectors of `inbox` (one receiver)."""
        receiver = inbox.dst[:1].expand_as(inbox.dst) if len(inbox) else inbox.dst  # one receiver
        inbox = Messages(inbox.src, receiver.clone(), inbox.payload)
        return self.aggregate_by_destination(inbox, weights, round_index)[1][0]

    def aggregate_by_destination(
        self, inbox: Messages, weights: torch.Tensor, round_index: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(dst (B,), aggregate (B, P)): each receiver's combination of what it received.
        `inbox` must be sorted by destination."""
        dst, updates, w, mask, src = pad_by_destination(inbox, weights)
        if self.defense is None:
            return dst, weighted_mean(updates, w)
        # always given: the screen counts one update per sender; the defense's own rule
        # sees the identities only where it declares `uses_identities`
        combined, kept = self.defense.aggregate(updates, w, mask, receivers=dst, senders=src)
        # one read back for the whole log: senders, and per slot 1 kept, 2 dropped, 0 padding
        status = torch.where(kept & mask, 1, torch.where(mask, 2, 0))
        senders, marks = torch.stack((src, status)).tolist()
        for ids, row in zip(senders, marks):
            self.log.append(
                (
                    round_index,
                    [s for s, m in zip(ids, row) if m == 1],
                    [s for s, m in zip(ids, row) if m == 2],
                )
            )
        return dst, combined
