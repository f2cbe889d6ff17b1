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


def test_an_interrupted_run_does_not_advance_the_sweep_bar(monkeypatch):
    """A sweep stopped by Ctrl-C: its runs come back "interrupted" and the bar says 0 of 2 done."""
    from types import SimpleNamespace

    import p4bench.sweep
    from p4bench.cli.studies import RunsProgress

    monkeypatch.setattr(p4bench.sweep, "describe_run", lambda planned, keys: "run")
    progress = RunsProgress("sweep")
    progress.start(total=2, skipped=0)
    try:
        progress.advance(SimpleNamespace(status="interrupted", summary=None), None)
        progress.advance(SimpleNamespace(status="interrupted", summary=None), None)
        assert progress.bar.tasks[0].completed == 0
        progress.advance(SimpleNamespace(status="finished", summary={"accuracy_mean": 0.5}), None)
        assert progress.bar.tasks[0].completed == 1
    finally:
        progress.stop()


def test_completion_offers_plugin_names_from_a_cache_it_refreshes(monkeypatch, tmp_path):
    import json

    from p4bench.cli import completion

    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path))
    assert completion.completer("method")("fed") == ["fedavg", "feddf"]  # built once, then cached
    cached = json.loads((tmp_path / "plugin-names.json").read_text())
    assert "p4" in cached["names"]["method"] and "m-krum" in cached["names"]["defense"]
    cached["names"]["method"] = ["from-the-cache"]
    (tmp_path / "plugin-names.json").write_text(json.dumps(cached))
    assert completion.plugin_names("method") == ["from-the-cache"]  # a TAB reads the cache, no registry
    cached["fingerprint"] = "stale"
    (tmp_path / "plugin-names.json").write_text(json.dumps(cached))
    assert "fedavg" in completion.plugin_names("method")  # other plugins installed: rebuilt
    (tmp_path / "plugin-names.json").write_text("not json")
    assert "fedavg" in completion.plugin_names("method")
