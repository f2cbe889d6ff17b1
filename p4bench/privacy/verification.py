"""The runner's post-processing verification of a method, cached per plugin version.

The first private run of a method (per plugin distribution and version, the method's
source, its options, model and features) runs the post-processing check
(`p4bench.privacy.post_processing`) on a small federation before it trains, a few
seconds; later runs read the verdict from a cache file in the derived-data cache
(`$P4BENCH_CACHE_DIR/post_processing.json`). A failed check makes the run uncertified
with the messages it found; a method that cannot be checked is uncertified too (a
release nobody can bound is not certified).

`P4BENCH_VERIFY=0` skips the check (the test suite does, except where it tests it):
such runs report their epsilon as "not yet verified".
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p4bench.config import RunConfig
from p4bench.data.paths import cache_dir

__all__ = ["VERIFY_ENV", "NOT_VERIFIED", "cache_key", "verification_enabled", "verify_method"]

VERIFY_ENV = "P4BENCH_VERIFY"
NOT_VERIFIED = "not yet verified"
_CACHE_FILE = "post_processing.json"
CHECK_VERSION = 2  # 2: the isolation replay added; an older verdict is checked again


def verification_enabled() -> bool:
    """False where $P4BENCH_VERIFY is 0, off, false or no."""
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _source_digest(cls: type) -> str:
    """A digest of the file defining `cls`: an editable install changes code without
    changing its version."""
    try:
        path = inspect.getsourcefile(cls)
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else "no-source"
    except (OSError, TypeError):
        return "no-source"


def cache_key(config: RunConfig, method_cls: type, provenance: dict[str, dict[str, str]]) -> str:
    """What the verdict depends on: the method's distribution, version and source, its
    options, the model and the features."""
    entry = provenance.get("method", {})
    parts = {
        "check": CHECK_VERSION,
        "method": config.method, "distribution": entry.get("distribution"), "version": entry.get("version"),
        "source": _source_digest(method_cls), "options": {k: str(v) for k, v in sorted(config.options.items())},
        "model": config.model, "features": config.features, "neighbouring": config.neighbouring,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


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


def verify_method(config: RunConfig, method_cls: type, provenance: dict[str, dict[str, str]],
                  plugin_manager: Any, run: Callable[..., Any]) -> dict[str, Any] | None:
    """The cached verdict of `config`'s method (`PostProcessingResult.as_dict()`), running
    the check with the runner's `run` where there is none; None where verification is
    switched off."""
    if not verification_enabled():
        return None
    from p4bench.privacy.post_processing import run_check

    key = cache_key(config, method_cls, provenance)
    path = cache_dir() / _CACHE_FILE
    cached = _read(path).get(key)
    if isinstance(cached, dict) and "status" in cached:
        return {**cached, "cached": True}
    verdict = run_check(config, run, plugin_manager).as_dict()
    cache = _read(path)
    cache[key] = verdict
    _write(path, cache)
    return {**verdict, "cached": False}
