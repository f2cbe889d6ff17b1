"""Joining a Ray cluster for the `ray` backend, with one clear line when that cannot work.

`p4bench sweep | tune | reproduce --backend ray --address HOST:PORT` connects to a cluster
started with `ray start --head` (plus `ray start --address HOST:PORT` on each worker). Two
things go wrong in practice and are reported before any run starts (UsageError, exit 2):

- nothing answers at the address (a typo, a stopped head, a firewall): checked with a plain
  TCP connection first, because `ray.init` would otherwise retry for a minute or more;
- the cluster wants a token. Since Ray 2.52 a cluster started with `RAY_AUTH_MODE=token`
  (and, from Ray 2.59, a local one when `~/.ray/auth_token` exists) refuses clients without
  its token: every node and the driver need the same `RAY_AUTH_MODE=token` and
  `RAY_AUTH_TOKEN` (or `RAY_AUTH_TOKEN_PATH`, or the default file `~/.ray/auth_token`;
  `ray get-auth-token` on the head prints it).

This module does not import Ray at import time; only `connect` and `node_id` need it.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from p4bench.errors import UsageError

__all__ = ["NODE_TAG", "cluster_endpoint", "check_reachable", "connect", "node_id"]

NODE_TAG = "ray_node_id"  # MLflow tag: the Ray node a run executed on
_TOKEN_HINT = (
    "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token "
    "(`ray get-auth-token` on the head node prints it) in the environment of this command"
)


def cluster_endpoint(address: str | None) -> tuple[str, int] | None:
    """(host, port) of an explicit cluster address (`HOST:PORT` or `ray://HOST:PORT`);
    None for no address or `auto` (Ray finds the cluster itself). A malformed address is
    a UsageError."""
    if not address or address.strip() == "auto":
        return None
    text = address.strip()
    parsed = urlparse(text if "://" in text else f"tcp://{text}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None:
        raise UsageError(
            f"--address must be HOST:PORT of a Ray head node (e.g. 10.0.0.1:6379), got {address!r}"
        )
    return parsed.hostname, port


def check_reachable(address: str | None, timeout: float = 3.0) -> None:
    """Raise UsageError unless something accepts connections at the cluster address."""
    endpoint = cluster_endpoint(address)
    if endpoint is None:
        return
    try:
        with socket.create_connection(endpoint, timeout=timeout):
            return
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
    raise UsageError(
        f"no Ray cluster answers at {address} ({reason}); start one with `ray start --head --port "
        f"{endpoint[1]}` and give its address to --address"
    )


def _is_auth_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "authentication" in text or "auth_token" in text or "unauthenticated" in text


def _check_token(address: str) -> None:
    """Ask the head's GCS for nothing, with Ray's own client: a missing or wrong token fails
    in about a second, where `ray.init` retries for some 20 s and then reports a bare
    ConnectionError (the reason only in Ray's log lines). Other failures are left to `ray.init`."""
    try:  # Ray's internal client of the GCS: skipped where a Ray version lacks it
        client = getattr(importlib.import_module("ray._raylet"), "GcsClient", None)
    except ImportError:
        return
    if client is None:
        return
    try:
        client(address=address)
    except Exception as exc:  # noqa: BLE001 - only a token failure is ours to report
        if _is_auth_failure(exc):
            raise UsageError(
                f"the Ray cluster at {address} requires token authentication: {_TOKEN_HINT}"
            ) from None


def connect(ray: Any, address: str | None, env_vars: Mapping[str, str]) -> None:
    """`ray.init` for the backend: a cluster at `address`, else a new local instance.
    Connection and token failures become one-line UsageErrors."""
    check_reachable(address)
    if address and "://" not in address and address.strip() != "auto":
        _check_token(address.strip())
    try:
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": dict(env_vars)},
        )
    except Exception as exc:  # noqa: BLE001 - Ray's errors differ between versions; named below
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        if _is_auth_failure(exc):
            raise UsageError(f"{where} requires token authentication: {_TOKEN_HINT}") from None
        if isinstance(exc, (ConnectionError, TimeoutError)) or "connect" in str(exc).lower():
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise UsageError(
                f"cannot connect to {where}: {type(exc).__name__}: {first} (a cluster started with "
                f"RAY_AUTH_MODE=token needs its token here too: {_TOKEN_HINT})"
            ) from None
        raise


def node_id() -> str | None:
    """The id of the Ray node running the caller (None outside a Ray worker)."""
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - evidence only; never fails a run
        return None
