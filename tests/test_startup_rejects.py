"""A bad input to `p4bench run` is refused before torch is imported wherever the check does
not need it: a value out of range, a value of the wrong type, a plugin name that no
installed plugin registers (read from the cached plugin listing) (issue 49, item 4)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# `p4bench ARGS` in a fresh interpreter that reports, on its last line, whether torch was
# imported by the time the command exited
REPORTING = r"""
import sys
from p4bench.cli import main
sys.argv = ["p4bench", *sys.argv[1:]]
try:
    main()
finally:
    print("torch imported:", "torch" in sys.modules)
"""


def _reject(*args: str) -> tuple[int, list[str], bool]:
    done = subprocess.run(
        [sys.executable, "-c", REPORTING, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    report = done.stdout.strip().splitlines()[-1]
    return done.returncode, done.stderr.strip().splitlines(), report == "torch imported: True"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rounds", "-1"], "invalid value for 'rounds'"),
        (["--threads", "0"], "invalid value for 'threads'"),
        (["--threads", "-4"], "invalid value for 'threads'"),
        (["--threads", "two"], "Invalid value for '--threads'"),
        (["--clip", "0"], "invalid value for 'clip'"),
        (["--eval", "nowhere"], "invalid value for 'eval_set'"),
    ],
)
def test_a_bad_value_is_one_line_exit_2_without_torch(args, says):
    code, lines, torch_imported = _reject("run", *args)
    assert code == 2
    assert len(lines) == 1 and says in lines[0], lines
    assert not torch_imported


@pytest.mark.parametrize(
    ("args", "kind"),
    [
        (["--method", "no-such-method"], "method"),
        (["--dataset", "no-such-data"], "dataset"),
        (["--attack", "no-such-attack"], "attack"),
    ],
)
def test_an_unknown_plugin_name_is_one_line_exit_2_without_torch(args, kind):
    _reject("list")  # the plugin listing cache is current (another test may have changed a file)
    code, lines, torch_imported = _reject("run", *args)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(f"error: unknown {kind} '{args[1]}'"), lines
    assert "fedavg" in lines[0] or kind != "method"  # the names that exist are listed
    assert not torch_imported


def test_without_a_current_listing_the_registry_still_refuses_the_name(monkeypatch):
    monkeypatch.setenv("P4BENCH_NO_PLUGIN_CACHE", "1")  # the listing is built: torch is imported
    code, lines, _ = _reject("run", "--method", "no-such-method")
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: unknown method 'no-such-method'")


def test_a_good_name_is_not_refused_by_the_early_check(tmp_path):
    # refused later, by a value only the run checks with its plugins (the method's options)
    code, lines, torch_imported = _reject(
        "run", "--method", "fedavg", "-o", "no_such_option=1", "--results-dir", str(tmp_path)
    )
    assert code == 2
    assert len(lines) == 1 and "no_such_option" in lines[0], lines
    assert torch_imported  # it got past the names to the plugins themselves
