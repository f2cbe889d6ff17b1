"""Checkpoints: what a run needs to continue exactly where it stopped.

After every round the runner saves (`snapshot`) the schedule position, every client
group's state and random-stream positions (Philox draw counters, the DP noise
generators), the server's state and stream, the state the method, attack and defense
objects keep between rounds, the privacy ledger's releases, the reports so far and the
MLflow run id, into `<run folder>/checkpoint.pt` (a temporary file, then `os.replace`,
so a crash never leaves half a checkpoint). Everything is saved as plain dicts, lists and
tensors, so `torch.load(..., weights_only=True)` reads it. Tensors are saved from the
host whatever the run's device, and restored onto the device of the run that resumes
(which may be another: `--resume --device`). A small `checkpoint.json`
next to it says which run it belongs to, so sweeps find checkpoints without loading them.

`p4bench run --resume` rebuilds the run from its saved config (data, partition and
models are pure functions of the seed), `restore`s the snapshot into the fresh driver and
goes on with the next round: with seeded randomness the result is bit-identical to an
uninterrupted run. Secret (OS-CSPRNG) randomness cannot be replayed: such a run resumes,
but its remaining rounds draw fresh noise.

Plugin objects (method, attack, defense) are saved generically: their instance
attributes that hold data (tensors, arrays, numbers, containers, torch generators and
plain objects of those) are saved and written back into the fresh objects; functions are
taken as stateless, and caches, the config, the model and public data are not saved.
A run whose plugins hold state that cannot be saved that way (P4L's signing keys) gets
no checkpoint: `RunCheckpointer.unsaved` names that state.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from p4bench.records import RoundReport
from p4bench.run.state_codec import capture, decode_into, encode, restore_object

if TYPE_CHECKING:
    from p4bench.engine.driver import RoundDriver
    from p4bench.privacy.ledger import PrivacyLedger

__all__ = [
    "CHECKPOINT_FILE",
    "META_FILE",
    "Checkpoint",
    "RunCheckpointer",
    "snapshot",
    "restore",
    "write",
    "load",
    "find_run_folder",
    "find_for_config",
    "encode",
    "decode_into",
    "remove",
    "pack_report",
    "unpack_report",
]

CHECKPOINT_FILE, META_FILE = "checkpoint.pt", "checkpoint.json"
FORMAT = 1


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint on disk: its folder, its metadata (`checkpoint.json`) and, once
    `state()` is called, the snapshot."""

    folder: Path
    meta: dict[str, Any]
    _state: dict[str, Any] | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The run's config as requested (before the method and runtime resolved it)."""
        return dict(self.meta["config"])

    def state(self) -> dict[str, Any]:
        """The snapshot (`checkpoint.pt`), read with `weights_only=True` (once). Its own
        copy of the metadata replaces `meta`: a write cut short between the two files
        leaves `checkpoint.json` a round behind, never the snapshot."""
        if self._state is None:
            self._state = torch.load(self.folder / CHECKPOINT_FILE, weights_only=True)
            self.meta.update(self._state.get("meta", {}))
        return self._state


# -- runs ------------------------------------------------------------------------------------


def snapshot(
    driver: RoundDriver,
    ledger: PrivacyLedger | None,
    extra: Mapping[str, Any],
    reports: list[torch.Tensor] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The run's state after a completed round, and the paths of plugin state that could
    not be saved. `extra` holds the runner's own figures (detection totals, time);
    `reports`, the driver's reports already packed (`pack_report`), else packed here."""
    unsaved: list[str] = []
    groups = []
    for index, group in enumerate(driver.groups):
        noise = getattr(group.dp, "noise", None)
        philox = getattr(noise, "philox", None)  # counter-based noise streams: their draw counters
        groups.append(
            {
                "rows": encode(group.rows),
                "state": encode(group.state, unsaved, f"group{index}.state"),
                "rng_calls": encode(group.rng.calls),
                "attack_rng_calls": encode(group.attack_rng.calls),
                "noise": [encode(g) for g in getattr(noise, "generators", [])],
                **({"noise_calls": encode(philox.calls)} if philox is not None else {}),
            }
        )
    job = driver.job
    state = {
        "position": driver.position,
        "total_bytes": driver.total_bytes,
        "receive_errors": driver.receive_errors,
        "groups": groups,
        "server_state": encode(driver.server_state, unsaved, "server_state"),
        "server_rng_calls": encode(driver.server_rng.calls),
        "torch_rng": torch.get_rng_state(),
        "method": capture(job.method, unsaved, "method"),
        "attack": capture(job.attack, unsaved, "attack"),
        "defense": capture(job.defense, unsaved, "defense"),
        "ledger": _ledger_state(ledger) if ledger is not None else None,
        "reports": reports if reports is not None else [pack_report(r) for r in driver.reports],
        **{k: encode(v) for k, v in extra.items()},
    }
    return state, unsaved


def restore(driver: RoundDriver, ledger: PrivacyLedger | None, state: Mapping[str, Any]) -> None:
    """Write a snapshot into a freshly built driver (and ledger) of the same run; its
    tensors go to the driver's device (where its streams' counters live)."""
    if len(state["groups"]) != len(driver.groups):
        raise ValueError("the checkpoint holds a different grouping of clients")
    device = driver.server_rng.calls.device
    on_device = None if device.type == "cpu" else device  # on the CPU: exactly as loaded
    for group, saved in zip(driver.groups, state["groups"]):
        if not torch.equal(group.rows, saved["rows"].to(group.rows.device)):
            raise ValueError("the checkpoint holds different client rows")
        group.state = decode_into(None, saved["state"], on_device)
        group.rng.calls = saved["rng_calls"].to(group.rng.calls.device, copy=True)
        group.attack_rng.calls = saved["attack_rng_calls"].to(
            group.attack_rng.calls.device, copy=True
        )
        noise = getattr(group.dp, "noise", None)
        for generator, generator_state in zip(getattr(noise, "generators", []), saved["noise"]):
            if generator is not None and generator_state is not None:
                decode_into(generator, generator_state)
        philox = getattr(noise, "philox", None)
        if philox is not None and "noise_calls" in saved:
            philox.calls = saved["noise_calls"].to(philox.calls.device, copy=True)
    driver.server_state = decode_into(None, state["server_state"], on_device)
    driver.server_rng.calls = state["server_rng_calls"].to(device, copy=True)
    job = driver.job
    for obj, key in ((job.method, "method"), (job.attack, "attack"), (job.defense, "defense")):
        restore_object(obj, state[key], on_device)
    driver.position, driver.total_bytes = int(state["position"]), int(state["total_bytes"])
    driver.receive_errors = int(state["receive_errors"])
    driver.reports = [unpack_report(r) for r in state["reports"]]
    if ledger is not None and state["ledger"] is not None:
        _restore_ledger(ledger, state["ledger"])
    torch.set_rng_state(state["torch_rng"])


def _ledger_state(ledger: PrivacyLedger) -> dict[str, Any]:
    return {
        "keys": encode(ledger.keys),
        "steps": encode(ledger.steps),
        "rounds": dict(ledger.rounds),
        "stopped": encode(ledger.stopped),
        "stop_log": encode(ledger.stop_log),
        "phase": ledger._current_phase,
        "round": ledger._current_round,
    }


def _restore_ledger(ledger: PrivacyLedger, saved: Mapping[str, Any]) -> None:
    ledger.keys = list(decode_into(None, saved["keys"]))
    ledger.steps = decode_into(None, saved["steps"])
    ledger.rounds = dict(saved["rounds"])
    ledger.stopped = decode_into(None, saved["stopped"])
    ledger.stop_log = list(decode_into(None, saved["stop_log"]))
    ledger._current_phase, ledger._current_round = saved["phase"], int(saved["round"])


def pack_report(report: RoundReport) -> torch.Tensor:
    """One round's report as one uint8 tensor (its plain encoding, serialised): a
    checkpoint holds every report so far, and thousands of small tensors pickle slowly."""
    buffer = io.BytesIO()
    torch.save(
        {f.name: encode(getattr(report, f.name)) for f in dataclasses.fields(report)}, buffer
    )
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack_report(packed: torch.Tensor) -> RoundReport:
    """The report `pack_report` packed."""
    saved = torch.load(io.BytesIO(packed.numpy().tobytes()), weights_only=True)
    return RoundReport(**{k: decode_into(None, v) for k, v in saved.items()})


class RunCheckpointer:
    """Writes a run's checkpoint after its rounds, into the run's local folder.

    Every round is checkpointed while a checkpoint takes under 50 ms; beyond that one is
    skipped while less than ten times its cost has passed since the last (at most about
    a tenth of the run goes to checkpoints), so a run with short rounds and a large state
    is checkpointed less often (resuming is exact from any round). `force` (a stop
    request, the end of an interrupted run) always writes."""

    def __init__(self, meta: Mapping[str, Any], ledger: PrivacyLedger | None) -> None:
        self.meta = dict(meta)
        self.ledger = ledger
        self.folder: Path | None = None
        self.written_step = 0
        self.unsaved: list[str] = []  # plugin state a checkpoint cannot hold: no checkpoints then
        self._packed: list[torch.Tensor] = []  # the reports so far, packed once each
        self._cost = 0.0
        self._last = time.perf_counter()

    def after_round(
        self, driver: RoundDriver, extra: Mapping[str, Any], force: bool = False
    ) -> None:
        """Checkpoint the driver's state after its last round (if due, or `force`)."""
        if self.folder is None or not driver.reports or self.unsaved:
            return
        step = driver.reports[-1].step
        due = self._cost < 0.05 or time.perf_counter() - self._last >= 10 * self._cost
        if step == self.written_step or not (force or due):
            return
        del self._packed[len(driver.reports) :]
        self._packed += [pack_report(r) for r in driver.reports[len(self._packed) :]]
        state, unsaved = snapshot(driver, self.ledger, extra, self._packed)
        if unsaved:  # resuming without it would not continue this run (e.g. P4L's signing keys)
            self.unsaved = sorted(set(unsaved))
            remove(self.folder)
            return
        last_phase = driver.method.phases()[-1].name
        meta = {
            **self.meta,
            "step": step,
            "position": driver.position,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "rounds_completed": sum(1 for r in driver.reports if r.phase == last_phase),
        }
        # the index (`checkpoint.json`: which run, for lookups) is written with the first
        # checkpoint and when the run stops; the snapshot carries the current round
        self._cost = write(self.folder, meta, state, index=force or not self.written_step)
        self._last = time.perf_counter()
        self.written_step = step


# -- files -----------------------------------------------------------------------------------


def write(
    folder: Path, meta: Mapping[str, Any], state: Mapping[str, Any], index: bool = True
) -> float:
    """Write the snapshot (with its metadata) into `folder` atomically, and with `index`
    the metadata as `checkpoint.json` too; returns the seconds it took. The snapshot's
    own copy of the metadata is the one that counts (`Checkpoint.state`)."""
    started = time.perf_counter()
    target, info = folder / CHECKPOINT_FILE, folder / META_FILE
    temporary = target.with_suffix(".pt.tmp")
    torch.save({"format": FORMAT, "meta": encode(dict(meta)), **state}, temporary)
    os.replace(temporary, target)
    if index or not info.is_file():
        temporary_meta = info.with_suffix(".json.tmp")
        temporary_meta.write_text(json.dumps({"format": FORMAT, **meta}, indent=1, default=str))
        os.replace(temporary_meta, info)
    return time.perf_counter() - started


def load(folder: Path) -> Checkpoint | None:
    """The checkpoint in a run folder, or None if it has none."""
    info = folder / META_FILE
    if not info.is_file() or not (folder / CHECKPOINT_FILE).is_file():
        return None
    return Checkpoint(folder, json.loads(info.read_text()))


def remove(folder: Path) -> None:
    """Delete a finished run's checkpoint (its results are final)."""
    for name in (CHECKPOINT_FILE, META_FILE):
        (folder / name).unlink(missing_ok=True)


def find_run_folder(
    reference: str, results_dir: str, tracking_uri: str | None = None
) -> Path | None:
    """The local folder of a run given as a folder, a local run id (the folder name's
    suffix) or an MLflow run id (its `results_dir` or `local_run_id` tag)."""
    path = Path(reference).expanduser()
    if path.is_dir():
        return path
    base = Path(results_dir)
    if base.is_dir() and reference and "/" not in reference:
        matches = sorted(p for p in base.glob(f"*-{reference}") if p.is_dir())
        matches = matches or ([base / reference] if (base / reference).is_dir() else [])
        if matches:
            return matches[-1]
    if not tracking_uri or not reference.isalnum():
        return None
    try:
        from p4bench.tracking.stores import store_client

        tags = store_client(tracking_uri).get_run(reference).data.tags
    except Exception:  # noqa: BLE001 - not a run of that store (or no store): not found
        return None
    if tags.get("results_dir") and Path(tags["results_dir"]).is_dir():
        return Path(tags["results_dir"])
    local = tags.get("local_run_id")
    return find_run_folder(local, results_dir) if local and local != reference else None


def find_for_config(
    results_dir: str, config_hash: str, tags: Mapping[str, str]
) -> Checkpoint | None:
    """The newest checkpoint under `results_dir` of a run with this requested config hash
    and these tags (a sweep's interrupted run)."""
    base = Path(results_dir)
    if not base.is_dir():
        return None
    found: list[tuple[float, Checkpoint]] = []
    for info in base.glob(f"*/{META_FILE}"):
        try:
            checkpoint = load(info.parent)
        except (OSError, ValueError):
            continue
        if checkpoint is None or checkpoint.meta.get("config_hash") != config_hash:
            continue
        if dict(checkpoint.meta.get("tags") or {}) == dict(tags):
            found.append((info.stat().st_mtime, checkpoint))
    return max(found, key=lambda pair: pair[0])[1] if found else None
