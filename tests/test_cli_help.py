"""`p4bench run --help` shows the run's real defaults (its options default to None so
that a --config file can set them)."""

from __future__ import annotations

import re

import pytest

from p4bench.cli import main
from p4bench.config import RunConfig


def test_run_help_shows_the_config_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    assert exit_info.value.code == 0
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    defaults = RunConfig()
    for option, value in (("--method", defaults.method), ("--clients", defaults.clients), ("--rounds", defaults.rounds),
                          ("--results-dir", defaults.results_dir), ("--accountant", defaults.accountant)):
        assert re.search(rf"{option} .*?\[default: \({re.escape(str(value))}\)\]", text), option
