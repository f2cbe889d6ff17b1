"""No keys left behind by a launcher that dies: local peers exit with it, and its folder
does not outlive it for long.

A launcher killed with SIGKILL runs no clean-up, so its local peers (`local.LocalPeers`)
take care of themselves: each is started with ``--owner-pid`` (the launcher) and then
(`exit_with_owner`) asks Linux to send it SIGTERM when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, through ctypes, where available), and watches the owner
from a thread as well (every `POLL_S`; the portable fallback, and a backstop for a main
thread busy in a long native call). When the owner is gone it removes its key folder
(``--tls-dir``) and exits at once.

The launcher's temporary folder holds an owner file (`write_owner`: its pid and start
time); the next local launch removes folders whose owner is dead (`sweep_orphans`), the
peers' logs with them unless the run asked to keep them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

log = logging.getLogger("p4bench.device")

__all__ = [
    "OWNER_FILE",
    "FOLDER_PREFIX",
    "POLL_S",
    "write_owner",
    "disown",
    "owner_alive",
    "sweep_orphans",
    "exit_with_owner",
    "set_parent_death_signal",
]

OWNER_FILE = "owner.json"
FOLDER_PREFIX = "p4bench-device-"  # local launches' temporary folders (tempfile.mkdtemp prefix)
POLL_S = 0.5  # how often a local peer checks that its launcher still lives
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22 of stat, counted after the command name


def write_owner(folder: Path, keep: bool = False) -> None:
    """Record this process as the owner of `folder` (`keep`: its logs outlive it)."""
    pid = os.getpid()
    (folder / OWNER_FILE).write_text(
        json.dumps({"pid": pid, "started": _start_time(pid), "keep": keep})
    )


def disown(folder: Path) -> None:
    """`folder` is kept on purpose (its keys removed): no sweep removes it."""
    (folder / OWNER_FILE).unlink(missing_ok=True)


def owner_alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` lives (and, with `started`, is the one that started then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: that pid is not the owner any more
        return False
    return started is None or _start_time(pid) in (None, started)


def sweep_orphans(folder: str | Path | None = None) -> list[Path]:
    """Remove the local launches' folders in `folder` (default: the temporary folder)
    whose owner has died: their keys always, the rest unless they were to be kept.
    Folders of other users, without an owner file, or with a live owner are left alone."""
    removed: list[Path] = []
    root = Path(folder if folder is not None else tempfile.gettempdir())
    for path in root.glob(f"{FOLDER_PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            owner = json.loads((path / OWNER_FILE).read_text())
            pid, started, keep = int(owner["pid"]), owner.get("started"), bool(owner.get("keep"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid == os.getpid() or owner_alive(pid, started):
            continue
        shutil.rmtree(path / "tls", ignore_errors=True)
        if keep:
            disown(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        log.warning(
            "removed the folder of a dead launcher (pid %d): %s%s",
            pid,
            path,
            " (logs kept)" if keep else "",
        )
        removed.append(path)
    return removed


def set_parent_death_signal(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when its parent dies; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def exit_with_owner(
    owner: int,
    key_dir: str | Path,
    poll_s: float = POLL_S,
    exit: Callable[[int], object] = os._exit,
) -> None:
    """Make this process exit, after removing `key_dir`, once process `owner` dies
    (see the module docstring). Call it early in the process's main thread."""
    parent_is_owner = os.getppid() == owner
    started = _start_time(owner)

    def gone() -> bool:  # once the parent died, getppid() names another process for good
        return os.getppid() != owner if parent_is_owner else not owner_alive(owner, started)

    lock = threading.Lock()

    def leave(why: str) -> None:
        with lock:  # the signal handler and the watcher may both get here
            shutil.rmtree(key_dir, ignore_errors=True)
            print(
                f"p4bench device peer: {why}; key folder removed, exiting",
                file=sys.stderr,
                flush=True,
            )
            exit(1)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if gone():
            leave(f"launcher (pid {owner}) gone")
        exit(128 + signum)  # a plain terminate: as SIGTERM's default action would

    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(
            signal.SIGTERM, on_sigterm
        )  # before asking: the signal may come at once
        if not set_parent_death_signal(signal.SIGTERM):
            signal.signal(signal.SIGTERM, previous)  # no such signal here: only the watcher below

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            if gone():
                leave(f"launcher (pid {owner}) gone")

    if gone():  # it died before we could ask to be told
        leave(f"launcher (pid {owner}) gone before this peer started")
    threading.Thread(target=watch, name="p4bench-owner-watch", daemon=True).start()
