"""An attack that boosts the malicious clients' honest update."""

from p4bench.api import Attack, Messages, Option, update_vectors, with_update_vectors


class BoostedUpdate(Attack):
    """Malicious clients send `boost` times the update they computed honestly.

    `tamper` gets the messages the malicious clients send in one exchange; the update
    part of each payload (the `update.*` keys) is what attacks replace, as vectors of
    shape (messages, parameters).
    """

    name = "boosted-update"
    description = "malicious clients send their honest update scaled by `boost` (explicit boosting, example plugin)"
    options = Attack.options + (
        Option("boost", float, 10.0, "factor applied to the honest update", low=0.0),
    )

    def __init__(self, config, num_classes):
        super().__init__(config, num_classes)
        self.boost = float(self.option_values["boost"])

    def tamper(self, exchange, messages, rng, reference=None):
        honest = update_vectors(messages.payload)
        return Messages(
            messages.src, messages.dst, with_update_vectors(messages.payload, self.boost * honest)
        )
