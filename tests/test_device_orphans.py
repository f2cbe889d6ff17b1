"""No keys left behind (issue 30, item 7): local peers exit with their launcher and remove
its key folder when it is killed outright, and the next local launch removes the folder of
a launcher that died. A real launcher subprocess with `--local-peers` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p4bench_device.orphans import OWNER_FILE, owner_alive, sweep_orphans, write_owner

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/cmdline").exists(), reason="finds the peer processes in /proc"
)


def _processes_mentioning(text: str) -> list[int]:
    """Pids of peer processes whose command line contains `text` (the launcher's folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and " serve " in cmdline:
            pids.append(int(entry.name))
    return pids


def _poll(predicate, timeout: float, step: float = 0.1) -> float | None:
    """Seconds until `predicate()` held, or None if it did not within `timeout` (bounded loop)."""
    started = time.monotonic()
    for _ in range(int(timeout / step) + 1):
        if predicate():
            return time.monotonic() - started
        time.sleep(step)
    return None


def test_sigkill_of_the_launcher_during_start_up_leaves_no_keys_and_no_peers(tmp_path):
    tmp = tmp_path / "tmp"  # the launcher's temporary folder goes here, not among other runs'
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "P4BENCH_VERIFY": "0"}
    argv = [
        sys.executable,
        "-c",
        "from p4bench.cli import main; main()",
        "run",
        "--method",
        "p4",
        "--local-peers",
        "2",
        "--rounds",
        "2",
        "--results-dir",
        str(tmp_path / "runs"),
    ]
    log = open(tmp_path / "launcher.log", "wb")
    launcher = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    peers: list[int] = []
    try:

        def starting() -> bool:  # keys written, both peers started (still importing: start-up)
            nonlocal peers
            folders = list(tmp.glob("p4bench-device-*"))
            peers = _processes_mentioning(str(folders[0])) if folders else []
            return bool(folders) and bool(list(folders[0].glob("tls/*.key"))) and len(peers) == 2

        assert _poll(starting, 120) is not None, (tmp_path / "launcher.log").read_text()[-2000:]
        folder = next(tmp.glob("p4bench-device-*"))
        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(30)
        keys_gone = _poll(lambda: not list(tmp.rglob("*.key")), 30)
        assert keys_gone is not None, sorted(str(p) for p in tmp.rglob("*.key"))
        keys_s = time.monotonic() - killed
        assert _poll(lambda: not _processes_mentioning(str(folder)), 30) is not None, (
            _processes_mentioning(str(folder))
        )
        print(
            f"after SIGKILL of the launcher: no key file after {keys_s:.2f} s, "
            f"no peer process after {time.monotonic() - killed:.2f} s"
        )
        assert (
            not (folder / "tls").exists() and (folder / OWNER_FILE).exists()
        )  # the rest: for the next launch
        assert sweep_orphans(tmp) == [folder] and not folder.exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        for pid in peers:  # only the peers this test started, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def test_the_sweep_removes_only_folders_of_dead_owners(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    folders = {
        name: tmp_path / f"p4bench-device-{name}" for name in ("dead", "kept", "alive", "unowned")
    }
    for folder in folders.values():
        (folder / "tls").mkdir(parents=True)
        (folder / "tls" / "0.key").write_text("key")
        (folder / "peer-0.log").write_text("log")
    for name, keep in (("dead", False), ("kept", True)):
        (folders[name] / OWNER_FILE).write_text(
            json.dumps({"pid": dead.pid, "started": None, "keep": keep})
        )
    write_owner(folders["alive"])
    assert owner_alive(os.getpid()) and not owner_alive(dead.pid)
    assert sorted(sweep_orphans(tmp_path)) == sorted([folders["dead"], folders["kept"]])
    assert not folders["dead"].exists()
    assert (folders["kept"] / "peer-0.log").exists() and not (folders["kept"] / "tls").exists()
    assert not (
        folders["kept"] / OWNER_FILE
    ).exists()  # logs kept on purpose: no later sweep touches them
    for name in ("alive", "unowned"):
        assert (folders[name] / "tls" / "0.key").exists()
    assert sweep_orphans(tmp_path) == []
