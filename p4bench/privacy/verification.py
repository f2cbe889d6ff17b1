"""How a run's privacy claim is verified by behaviour (`--verify`), and the verdict cache.

Three modes (`--verify`, or `$P4BENCH_VERIFY` where the run does not say):

- ``full`` (the default): the configuration that ran is checked at its own size
  (`p4bench.privacy.run_verification`): the run itself is recorded and replayed once
  after its last round, or, where it cannot be its own recording (a device runtime, a
  GPU, secret noise, a resumed run), a recorded run and its replay at its size run
  beside it. Only this mode certifies a run's epsilon.
- ``stand-in``: the earlier small check, a 4-client, 2-round federation of the same
  method (`p4bench.privacy.post_processing.run_check`): a few seconds, but evidence about
  a stand-in, so the run is printed "verified on a 4-client, 2-round stand-in" and is
  not certified.
- ``off`` (``P4BENCH_VERIFY=0``): no check; an unverified epsilon is not certified.

A verdict is reused only for an identical configuration (every field but the seed and
where results are written) and identical code: the cache key holds a digest of every
file of every distribution whose plugin the run used, and of p4bench's own code
(`p4bench.privacy.code_digest`), so editing any module of a plugin's package checks it
again. Verdicts live in `$P4BENCH_CACHE_DIR/post_processing.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from p4bench.config import RunConfig
from p4bench.data.paths import cache_dir
from p4bench.errors import ConfigError

__all__ = [
    "MODES",
    "NOT_VERIFIED",
    "VERIFY_ENV",
    "cache_key",
    "cached_verdict",
    "store_verdict",
    "verification_enabled",
    "verification_mode",
    "verify_method",
]

VERIFY_ENV = "P4BENCH_VERIFY"
MODES = ("full", "stand-in", "off")
NOT_VERIFIED = "not verified"
_CACHE_FILE = "post_processing.json"
CHECK_VERSION = (
    3  # 3: run-size checks, fused releases forced as a whole, kept sums beside the run's own
)
# fields that change where results go or how work is chunked, never what a method sends
_NOT_IN_KEY = ("seed", "experiment", "tracking_uri", "results_dir", "memory_budget_gb", "verify")
_ENV_WORDS = {
    "0": "off",
    "off": "off",
    "false": "off",
    "no": "off",
    "1": "full",
    "on": "full",
    "true": "full",
    "yes": "full",
    "full": "full",
    "stand-in": "stand-in",
    "standin": "stand-in",
}


def verification_mode(config: RunConfig | None = None) -> str:
    """The run's `verify` field, else `$P4BENCH_VERIFY` (0/off/false/no: off; 1/full:
    full; stand-in), else full. An unknown word in the environment is a ConfigError."""
    chosen = getattr(config, "verify", None)
    if chosen:
        return str(chosen)
    word = os.environ.get(VERIFY_ENV, "full").strip().lower()
    if word not in _ENV_WORDS:
        raise ConfigError(
            "verify", f"${VERIFY_ENV}={word!r}: use one of {', '.join(MODES)} (or 0/1)"
        )
    return _ENV_WORDS[word]


def verification_enabled() -> bool:
    """False where verification is off (`$P4BENCH_VERIFY` 0, off, false or no)."""
    return verification_mode() != "off"


def cache_key(config: RunConfig, classes: list[type], mode: str) -> str:
    """What a verdict depends on: the whole configuration but the seed, the mode, and the
    code of every plugin the run used (`classes`) and of p4bench."""
    from p4bench.privacy.code_digest import code_digest

    settings = {k: v for k, v in config.to_dict().items() if k not in _NOT_IN_KEY}
    code = sorted({code_digest(cls) for cls in classes})
    parts = {"check": CHECK_VERSION, "mode": mode, "config": settings, "code": code}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _path() -> Path:
    return cache_dir() / _CACHE_FILE


def _read(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
        return loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, cache: dict[str, Any]) -> None:
    """Atomically: runs of a sweep in other processes may write at the same time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(cache, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError:
        pass  # a read-only cache: the next run checks again


def cached_verdict(key: str) -> dict[str, Any] | None:
    """The verdict stored under `key`, marked `cached`, or None."""
    cached = _read(_path()).get(key)
    if isinstance(cached, dict) and "status" in cached:
        return {**cached, "cached": True}
    return None


def store_verdict(key: str, verdict: dict[str, Any]) -> dict[str, Any]:
    """Keep `verdict` under `key`; returns it marked as freshly checked."""
    cache = _read(_path())
    cache[key] = verdict
    _write(_path(), cache)
    return {**verdict, "cached": False}


def verify_method(
    config: RunConfig, classes: list[type], plugin_manager: Any, run: Any
) -> dict[str, Any]:
    """The stand-in verdict of `config`'s method (`PostProcessingResult.as_dict()`), from
    the cache or by running the small check with the runner's `run`."""
    from p4bench.privacy.post_processing import run_check

    key = cache_key(config, classes, "stand-in")
    cached = cached_verdict(key)
    if cached is not None:
        return cached
    return store_verdict(key, run_check(config, run, plugin_manager).as_dict())
