"""The runner's privacy verification of one run (`--verify`, `p4bench.privacy.verification`).

Decided before the first round: a cached verdict for the same configuration and code,
the stand-in check, a check at the run's size beside it, or the run itself recorded
(`p4bench.privacy.run_verification.RunRecorder`) and replayed once after its last round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

from p4bench.privacy.run_verification import RunRecorder, not_recordable, verify_at_size
from p4bench.privacy.verification import (
    cache_key,
    cached_verdict,
    store_verdict,
    verification_mode,
    verify_method,
)

__all__ = ["RunVerification"]


class RunVerification:
    """One run's verification: `recording()` around its rounds, `finish(...)` after them;
    the verdict goes into `prepared.info.certification`."""

    def __init__(
        self,
        prepared: Any,
        registry: Any,
        pm: Any,
        run: Callable[..., Any],
        *,
        enabled: bool,
        resumed: bool,
    ) -> None:
        self.prepared, self.pm, self.run = prepared, pm, run
        self.recorder: RunRecorder | None = None
        self.key: str | None = None
        certification = prepared.info.certification
        if certification is None or not certification.private:
            return
        self.mode = verification_mode(prepared.config) if enabled else "off"
        if self.mode == "off":
            self._apply(None)
            return
        classes = [
            registry.get(kind, entry["name"])
            for kind, entry in sorted(prepared.info.plugins.items())
        ]
        if self.mode == "stand-in":
            self._apply(verify_method(prepared.config, classes, pm, run))
            return
        self.key = cache_key(prepared.config, classes, "full")
        cached = cached_verdict(self.key)
        if cached is not None:
            self._apply(cached)
            return
        why = not_recordable(prepared, resumed)
        if why is not None:
            self._apply(
                store_verdict(self.key, verify_at_size(prepared.config, run, pm, why).as_dict())
            )
            return
        self.recorder = RunRecorder(prepared)

    def _apply(self, verdict: dict[str, Any] | None) -> None:
        info = self.prepared.info
        info.certification = info.certification.with_post_processing(verdict)
        self.verdict = verdict

    def recording(self) -> Any:
        """Around the run's rounds: records them where the run is its own recording."""
        return self.recorder.recording_run() if self.recorder is not None else nullcontext()

    def finish(self, outcome: Any, attached: Sequence[object], **run_options: Any) -> None:
        """After the run's last round: replay it once and judge (observers of the run are
        detached meanwhile, but for a progress display, which shows the replay)."""
        if self.recorder is None or self.key is None:
            return
        recorder, self.recorder = self.recorder, None
        stopped = (
            outcome.budget_overran_at is not None
        )  # the replay stops where the time budget stopped the run
        steps = int(outcome.reports[-1].step) if outcome.reports else None
        shown = [o for o in attached if getattr(o, "shows_progress", False)]
        with _detached(self.pm, attached):
            try:
                result = recorder.verdict(
                    self.run,
                    self.pm,
                    stop_at_step=steps if stopped else None,
                    observers=shown,
                    **run_options,
                )
            except KeyboardInterrupt:
                self._apply(None)
                self.prepared.info.certification = self.prepared.info.certification.with_reasons(
                    ["the verification replay was interrupted"]
                )
                return
        verdict = result.as_dict()
        self._apply(
            store_verdict(self.key, verdict) if not stopped else {**verdict, "cached": False}
        )

    @property
    def summary(self) -> dict[str, Any]:
        """The summary's verification fields."""
        verdict = getattr(self, "verdict", None)
        if not hasattr(self, "mode"):
            return {}
        fields: dict[str, Any] = {"verify": self.mode}
        if verdict:
            fields.update(
                verification_scope=verdict.get("scope"),
                verification_notes=verdict.get("notes", []),
                verification_cached=bool(verdict.get("cached")),
                verification_cpu_s=round(float(verdict.get("cpu_seconds", 0.0)), 3),
                verification_wall_s=round(float(verdict.get("seconds", 0.0)), 3),
                verification_messages=verdict.get("messages"),
                verification_releases=verdict.get("releases"),
            )
        return fields


@contextmanager
def _detached(pm: Any, observers: Sequence[object]) -> Iterator[None]:
    """The run's observers off `pm` while the replay runs (its hooks are not the run's)."""
    registered = [o for o in observers if pm.is_registered(o)]
    for observer in registered:
        pm.unregister(observer)
    try:
        yield
    finally:
        for observer in registered:
            pm.register(observer)
