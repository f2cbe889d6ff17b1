"""`p4bench run --help` shows the run's real defaults (its options default to None so
that a --config file can set them)."""

from __future__ import annotations

import re
from pathlib import Path

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
    for option, value in (
        ("--method", defaults.method),
        ("--clients", defaults.clients),
        ("--rounds", defaults.rounds),
        ("--results-dir", defaults.results_dir),
        ("--accountant", defaults.accountant),
    ):
        assert re.search(rf"{option} .*?\[default: \({re.escape(str(value))}\)\]", text), option


def test_an_interrupted_run_does_not_advance_the_sweep_bar(monkeypatch):
    """A sweep stopped by Ctrl-C: its runs come back "interrupted" and the bar says 0 of 2 done."""
    from types import SimpleNamespace

    import p4bench.studies.sweep
    from p4bench.cli.studies import RunsProgress

    monkeypatch.setattr(p4bench.studies.sweep, "describe_run", lambda planned, keys: "run")
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


def test_list_and_completion_read_a_plugin_listing_cache_they_refresh(
    monkeypatch, tmp_path, capsys
):
    """`list` and TAB completion show the cached listing while its fingerprint (versions,
    entry points, the plugin packages' files) is current, and rebuild it when it is not."""
    import json
    import os

    from p4bench.cli import completion, plugin_cache

    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("P4BENCH_NO_PLUGIN_CACHE", raising=False)
    assert completion.completer("method")("fed") == ["fedavg", "feddf"]  # built once, then cached
    path = tmp_path / "plugin-listing.json"
    cached = json.loads(path.read_text())
    assert cached["fingerprint"] == plugin_cache.fingerprint()
    assert "p4" in [e["name"] for e in cached["listing"]["method"]]
    cached["listing"]["method"] = [
        {"name": "from-the-cache", "distribution": "x", "version": "1", "description": "d"}
    ]
    path.write_text(json.dumps(cached))
    assert completion.plugin_names("method") == [
        "from-the-cache"
    ]  # read from the cache, no registry
    from p4bench.cli import main

    with pytest.raises(SystemExit):
        main(["list"])
    assert "from-the-cache" in capsys.readouterr().out
    import p4bench.cli.listing as listing_module

    source = Path(listing_module.__file__)  # a plugin package's file changes: the fingerprint does
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        assert "fedavg" in completion.plugin_names("method")
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    path.write_text("not json")
    assert "fedavg" in completion.plugin_names("method")


def test_a_plugin_registered_in_code_is_listed_not_hidden_by_the_cache(
    monkeypatch, tmp_path, capsys
):
    from p4bench.cli import main
    from p4bench.hookspecs import hookimpl
    from p4bench.host.manager import default_plugin_manager, reset_default

    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["list"])  # fills the cache
    capsys.readouterr()

    class InCode:
        @hookimpl
        def register_methods(self):
            from p4bench_baselines.fedavg import FedAvg

            class Registered(FedAvg):
                name = "registered-in-code"

            return [Registered]

    reset_default()
    default_plugin_manager().register(InCode())
    try:
        with pytest.raises(SystemExit):
            main(["list", "--json"])
        import json

        assert "registered-in-code" in [
            e["name"] for e in json.loads(capsys.readouterr().out)["method"]
        ]
    finally:
        reset_default()


def test_moved_cli_names_still_import_from_their_old_homes():
    """The summary table moved to p4bench.cli.summary_table and the problem warnings to
    p4bench.cli.problems; code importing them from where they were keeps working."""
    from p4bench.cli.problems import warn_plugin_problems
    from p4bench.cli.problems import warn_plugin_problems as moved_warn
    from p4bench.cli.summary_table import print_summary, rejections_line
    from p4bench.cli.summary_table import print_summary as moved_print
    from p4bench.cli.summary_table import rejections_line as moved_line

    assert (warn_plugin_problems, print_summary, rejections_line) == (
        moved_warn,
        moved_print,
        moved_line,
    )
