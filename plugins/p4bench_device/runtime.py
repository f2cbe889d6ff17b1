"""The `device` runtime: one process per client (and the server), messages over mutually
authenticated TLS, driven by the `Launcher` (`p4bench_device.launcher`). Its options
are checked here, before any peer starts; the run's `--memory-budget` becomes the peers'
inbound buffer budget (`Limits.buffer_budget_bytes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from p4bench.engine.runtime import Job, Outcome, RoundReport, Runtime
from p4bench.errors import UsageError
from p4bench.options import resolve_options
from p4bench_device.launcher import Launcher
from p4bench_device.local import LocalPeers
from p4bench_device.peers import PeersFile
from p4bench_device.protocol import DEVICE_OPTIONS, Limits

__all__ = ["DeviceRuntime"]


class DeviceRuntime(Runtime):
    """One process per client (and the server), messages over mutually authenticated
    TLS: Raspberry Pis listed in a peers file, or `--local-peers N` on 127.0.0.1."""

    name = "device"
    description = (
        "one process per client over TLS sockets (Raspberry Pis, or --local-peers N on 127.0.0.1)"
    )
    separate_parties = True  # each peer's noise and batches come from its own secret source
    options = DEVICE_OPTIONS

    def execute(self, job: Job, on_round: Callable[[RoundReport], None]) -> Outcome:
        values = resolve_options(self.options, job.config.options)
        config, options = job.config, {k: v for k, v in values.items() if v is not None}
        limits = Limits.from_options(options)
        if config.memory_budget_gb is not None:  # the peers' inbound buffers share it
            limits = replace(
                limits, buffer_budget_bytes=max(1, int(config.memory_budget_gb * (1 << 30)))
            )
        uses_server = job.method.capabilities.uses_server
        link, profile = _link_and_profile(options)
        local = options.get("device_local_peers")
        if local is not None:
            if isinstance(local, bool) or not isinstance(local, int) or local < 1:
                raise UsageError(f"--local-peers must be an integer >= 1, got {local!r}")
            if local != config.clients:
                raise UsageError(
                    f"--local-peers {local} must equal --clients {config.clients} (one client per peer)"
                )
            power = options.get("device_power_command")
            with LocalPeers(
                local,
                uses_server,
                power=str(power) if power else None,
                power_interval=float(options.get("device_power_interval_s", 1.0)),
                keep=bool(options.get("device_keep_logs", False)),
                device_profile=profile,
            ) as cluster:
                return Launcher(
                    cluster.peers,
                    cluster.tls_dir,
                    limits,
                    check=cluster.check,
                    local=True,
                    on_connected=cluster.forget_keys,
                    link=link,
                    profile=profile,
                ).run(job, on_round)
        peers_path, tls_dir = options.get("device_peers"), options.get("device_tls_dir")
        if not peers_path or not tls_dir:
            raise UsageError(
                "the device runtime needs --local-peers N, or a peers file and TLS folder "
                "(`p4bench device launch --peers peers.yaml --tls-dir DIR ...`)"
            )
        peers = PeersFile.load(str(peers_path))
        if peers.num_clients != config.clients:
            raise UsageError(
                f"{peers_path} lists {peers.num_clients} clients but the run has --clients {config.clients}"
            )
        if uses_server and peers.server is None:
            raise UsageError(
                f"method '{config.method}' uses a server: add a peer with role: server to {peers_path}"
            )
        if not uses_server and peers.server is not None:
            raise UsageError(
                f"method '{config.method}' uses no server: remove the server peer from {peers_path}"
            )
        if profile:
            raise UsageError(
                "--option device_profile applies to --local-peers; start each device's peer with "
                "`p4bench device serve --device-profile NAME` instead"
            )
        return Launcher(peers, str(tls_dir), limits, link=link).run(job, on_round)


def _link_and_profile(options: dict[str, Any]) -> tuple[str | None, str | None]:
    """The run's link and device profile options, checked before any peer starts."""
    from p4bench_device.link import parse_link
    from p4bench_device.profile import DEVICE_PROFILES

    link, profile = options.get("device_link"), options.get("device_profile")
    if link:
        parse_link(str(link))
    if profile and str(profile) not in DEVICE_PROFILES:
        raise UsageError(
            f"unknown device profile {profile!r}; valid: {', '.join(sorted(DEVICE_PROFILES))}"
        )
    return (str(link) if link else None), (str(profile) if profile else None)
