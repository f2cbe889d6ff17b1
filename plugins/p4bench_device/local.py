"""Local peers for development and tests: `p4bench device serve` subprocesses on
127.0.0.1 with a fresh CA in a private temporary folder, whose keys never outlive the
run (the CA key is deleted at once, the peers' keys once they have loaded them, the
folder on exit, also when the launcher is terminated). A launcher killed outright
(SIGKILL) cleans nothing: its peers exit with it and remove the keys themselves, and the
next local launch removes its folder (`orphans`)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any

from p4bench.errors import P4BenchError, UsageError
from p4bench.rng import SERVER_ID
from p4bench_device.orphans import FOLDER_PREFIX, disown, sweep_orphans, write_owner
from p4bench_device.peers import PeersFile, PeerSpec
from p4bench_device.tls import init_tls_dir

log = logging.getLogger("p4bench.device")

__all__ = ["LocalPeers", "LocalPeerError", "free_ports"]

# what `signal.signal` takes and returns (typeshed's own alias is private)
SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class LocalPeerError(P4BenchError):
    """A local peer process exited while the launcher waited for it."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalPeers:
    """`clients` peers (plus a server peer) as ``p4bench device serve`` subprocesses on
    127.0.0.1, with a fresh CA, for development and tests. A context manager: leaving
    it stops every process it started and removes its folder (kept if `keep`)."""

    def __init__(
        self,
        clients: int,
        server: bool = False,
        power: str | None = None,
        power_interval: float = 1.0,
        threads: int | None = None,
        keep: bool = False,
        idle_timeout: float = 600.0,
        keep_serving: bool = False,
        device_profile: str | None = None,
    ) -> None:
        if clients < 1:
            raise UsageError(f"--local-peers must be >= 1, got {clients}")
        self.clients, self.server, self.power, self.power_interval, self.keep = (
            clients,
            server,
            power,
            power_interval,
            keep,
        )
        self.idle_timeout = idle_timeout  # peers left behind by a dead launcher exit by themselves
        self.keep_serving, self.device_profile = keep_serving, device_profile
        nodes = clients + int(server)
        self.threads = threads or max(1, (os.cpu_count() or 1) // nodes)
        sweep_orphans()  # folders of launchers killed before they could clean up
        self.folder = Path(
            tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        )  # private (0700): holds the run's keys
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        try:
            write_owner(self.folder, keep)
            ports = free_ports(nodes)
            specs = [PeerSpec(str(i), "127.0.0.1", ports[i], i) for i in range(clients)]
            if server:
                specs.append(PeerSpec("server", "127.0.0.1", ports[-1], SERVER_ID))
            self.peers = PeersFile(tuple(specs))
            self.peers_path = self.peers.write(self.folder / "peers.yaml")
            self.tls_dir = self.folder / "tls"
            init_tls_dir(self.tls_dir, [(p.id, [p.host, "localhost"]) for p in specs])
            (
                self.tls_dir / "ca.key"
            ).unlink()  # no certificate is issued later: the CA key is never needed again
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def __enter__(self) -> LocalPeers:
        self._previous_sigterm = _raise_on_sigterm()
        try:
            self.start()
        except BaseException:
            self.stop(failed=True)
            _restore_sigterm(self._previous_sigterm)
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop(failed=exc_info[0] is not None)
        finally:
            _restore_sigterm(self._previous_sigterm)

    def forget_keys(self) -> None:
        """Delete the key files once every peer has loaded its own (they are listening, the
        launcher is connected): a launcher killed later leaves no key material behind."""
        for path in self.tls_dir.glob("*.key"):
            path.unlink(missing_ok=True)

    def command(self, spec: PeerSpec) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "p4bench_device",
            "serve",
            "--peer-id",
            spec.id,
            "--listen",
            f"{spec.host}:{spec.port}",
            "--peers",
            str(self.peers_path),
            "--tls-dir",
            str(self.tls_dir),
            "--threads",
            str(self.threads),
            "--idle-timeout",
            str(self.idle_timeout),
            "--owner-pid",
            str(os.getpid()),
        ]  # exits (removing the keys) when this launcher dies
        if self.keep_serving:
            argv.append("--keep-serving")
        if self.device_profile:
            argv += ["--device-profile", self.device_profile]
        if self.power:
            argv += ["--power-command", self.power, "--power-interval", str(self.power_interval)]
        return argv

    def start(self) -> None:
        for spec in self.peers.peers:
            handle = open(self.folder / f"peer-{spec.id}.log", "wb")
            self._logs.append(handle)
            self.processes[spec.id] = subprocess.Popen(
                self.command(spec),
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def log_tail(self, peer: str, lines: int = 15) -> str:
        path = self.folder / f"peer-{peer}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def check(self) -> None:
        """Raise if a peer process has already exited (while the launcher waits for it)."""
        for peer, process in self.processes.items():
            code = process.poll()
            if code is not None:
                raise LocalPeerError(
                    f"local peer {peer} exited with code {code}:\n{self.log_tail(peer)}"
                )

    def stop(self, failed: bool = False, timeout: float = 15.0) -> None:
        """Wait for the peers to exit (they do after the launcher's stop); terminate, then
        kill, those that do not. After a failure the peers may never have heard stop."""
        deadline = time.monotonic() + (0.0 if failed else timeout)
        for process in self.processes.values():
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        for handle in self._logs:
            handle.close()
        shutil.rmtree(
            self.tls_dir, ignore_errors=True
        )  # the run's keys never outlive it, logs kept or not
        if failed or self.keep:
            disown(self.folder)  # kept on purpose: no later sweep removes it
            log.warning("local peer logs kept in %s", self.folder)
        else:
            shutil.rmtree(self.folder, ignore_errors=True)


def _raise_on_sigterm() -> SignalHandler:
    """Turn SIGTERM into SystemExit while local peers run, so a killed launcher still runs
    its clean-up (stop the peers, delete the keys). Only the main thread can do this."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def _restore_sigterm(previous: SignalHandler) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)
