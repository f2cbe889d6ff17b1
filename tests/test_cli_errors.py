"""The command line's exception boundary (`p4bench.cli.main`): a failure the user caused is
one line on stderr and exit 2, a bug shows its traceback and asks to be reported (exit 1),
an unhandled Ctrl-C is one line and exit 130; the up-front path checks
(`p4bench.run.preflight`); `--version`; the smoke-run label of `reproduce --quick`."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from p4bench.cli import main
from p4bench.errors import UsageError, user_error_line

PROC = pytest.mark.skipif(
    not Path("/proc/self").is_dir(), reason="needs Linux /proc (a folder nothing can be made in)"
)
SMALL = ["--method", "local", "--clients", "4", "--rounds", "1"]


def invoke(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


# -- finding 1 of the issue: each is one line and exit 2 ----------------------------------------


@PROC
def test_run_with_a_results_dir_that_cannot_be_made(capsys):
    code, _, err = invoke(["run", *SMALL, "--results-dir", "/proc/x"], capsys)
    line = one_error_line(err)
    assert code == 2 and "/proc/x" in line and "[Errno" in line


@PROC
def test_run_with_an_sqlite_store_whose_folder_cannot_be_made(capsys, results_dir):
    code, _, err = invoke(
        [
            "run",
            *SMALL,
            "--results-dir",
            results_dir,
            "--tracking-uri",
            "sqlite:////proc/nope/mlflow.db",
        ],
        capsys,
    )
    line = one_error_line(err)
    assert code == 2 and "/proc/nope" in line


def test_run_with_a_results_dir_under_a_file(capsys, tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    code, _, err = invoke(["run", *SMALL, "--results-dir", str(tmp_path / "afile" / "sub")], capsys)
    line = one_error_line(err)
    assert code == 2 and "afile" in line


@PROC
def test_compare_with_a_plot_path_that_cannot_be_written(capsys, results_dir):
    # checked before the store is read: no experiment needed
    code, out, err = invoke(
        ["compare", "--experiment", "none", "--results-dir", results_dir, "--plot", "/proc/x.png"],
        capsys,
    )
    line = one_error_line(err)
    assert code == 2 and "/proc/x.png" in line and out == ""


@PROC
def test_topology_show_with_a_plot_path_that_cannot_be_written(capsys):
    code, out, err = invoke(
        ["topology", "show", "ring", "--clients", "4", "--plot", "/proc/x.png"], capsys
    )
    line = one_error_line(err)
    assert code == 2 and "/proc/x.png" in line and out == ""


def test_a_plot_format_matplotlib_cannot_write_is_refused_up_front(capsys, tmp_path):
    code, _, err = invoke(
        ["topology", "show", "ring", "--clients", "4", "--plot", str(tmp_path / "g.xyz")], capsys
    )
    assert code == 2 and "unknown image format '.xyz'" in one_error_line(err)


def test_bad_yaml_in_a_config_file_or_an_option_is_one_line(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("rounds: [1,\n")
    code, _, err = invoke(["run", "--config", str(config)], capsys)
    line = one_error_line(err)
    assert code == 2 and str(config) in line and "line 2" in line
    code, _, err = invoke(["run", *SMALL, "-o", "x=[1"], capsys)
    line = one_error_line(err)
    assert code == 2 and "invalid YAML in 'x=[1'" in line


def test_shards_per_client_zero_is_refused_not_dropped(capsys, results_dir):
    # issue 45: `--shards-per-client 0` was dropped as falsy and the run trained with the default 2
    for value in ("0", "-1"):
        code, _, err = invoke(
            [
                "run",
                *SMALL,
                "--partitioner",
                "shards",
                "--shards-per-client",
                value,
                "--results-dir",
                results_dir,
            ],
            capsys,
        )
        line = one_error_line(err)
        assert (
            code == 2
            and "options.shards_per_client" in line
            and ">= 1" in line
            and f"got {value}" in line
        )


# -- the boundary: stores, disks, bugs, interrupts -----------------------------------------------


def _compare_failing_with(monkeypatch, exc: BaseException) -> None:
    """`compare` whose store access raises `exc`, from a frame that names the store's URI."""
    import p4bench.studies.compare

    def compare_experiment(uri, *args, **kwargs):
        raise exc

    monkeypatch.setattr(p4bench.studies.compare, "compare_experiment", compare_experiment)


def test_a_locked_store_is_one_line_naming_it(capsys, monkeypatch, results_dir):
    _compare_failing_with(monkeypatch, sqlite3.OperationalError("database is locked"))
    code, _, err = invoke(
        ["compare", "--experiment", "e", "--tracking-uri", "sqlite:////data/mlflow.db"], capsys
    )
    line = one_error_line(err)
    assert code == 2 and "sqlite:////data/mlflow.db" in line and "database is locked" in line


def test_a_full_disk_is_one_line(capsys, monkeypatch):
    _compare_failing_with(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    code, _, err = invoke(["compare", "--experiment", "e"], capsys)
    line = one_error_line(err)
    assert code == 2 and f"[Errno {errno.ENOSPC}]" in line


def test_an_unreachable_tracking_server_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    code, _, err = invoke(
        ["compare", "--experiment", "e", "--tracking-uri", "http://127.0.0.1:9"], capsys
    )
    line = one_error_line(err)
    assert code == 2 and "http://127.0.0.1:9" in line


def test_a_bug_shows_its_traceback_and_asks_for_a_report(capsys, monkeypatch):
    import p4bench.topology.summary

    def summarize(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(p4bench.topology.summary, "summarize", summarize)
    code, _, err = invoke(["topology", "show", "ring", "--clients", "4"], capsys)
    assert code == 1
    assert "Traceback (most recent call last)" in err and "RuntimeError: simulated bug" in err
    last = err.strip().splitlines()[-1]
    assert (
        "this is a bug in p4bench" in last and "please report it with the traceback above" in last
    )


def test_an_unhandled_interrupt_is_one_line_and_exit_130(capsys, monkeypatch):
    import p4bench.cli
    import p4bench.topology.summary

    def summarize(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(p4bench.topology.summary, "summarize", summarize)
    code, _, err = invoke(["topology", "show", "ring", "--clients", "4"], capsys)
    assert code == 130 and err.strip() == "interrupted"

    class Stopped(
        KeyboardInterrupt
    ):  # a stop that knows where its results are (p4bench.run.interrupts.RunInterrupted)
        pass

    def stopped(*args, **kwargs):
        raise Stopped("interrupted after round 2 of 5; resume with: p4bench run --resume runs/x")

    monkeypatch.setattr(p4bench.topology.summary, "summarize", stopped)
    code, _, err = invoke(["topology", "show", "ring", "--clients", "4"], capsys)
    assert (
        code == 130
        and err.strip()
        == "interrupted after round 2 of 5; resume with: p4bench run --resume runs/x"
    )

    def build_app():  # Ctrl-C while the app is built (start-up)
        raise KeyboardInterrupt

    monkeypatch.setattr(p4bench.cli, "build_app", build_app)
    code, _, err = invoke(["list"], capsys)
    assert code == 130 and err.strip() == "interrupted"


def test_ctrl_c_while_the_script_imports_the_command_line_is_one_line(capsys, monkeypatch):
    # issue 45: Ctrl-C in the first 0.1 s printed the traceback of `from p4bench.cli import main`
    import builtins
    import tomllib

    import p4bench.cli
    from p4bench import console

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    assert scripts["p4bench"] == "p4bench.console:main"
    called = []
    monkeypatch.setattr(p4bench.cli, "main", lambda: called.append(True))
    console.main()  # no interrupt: the command line's own main, as the script
    assert called == [True]

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "p4bench.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(SystemExit) as info:
        console.main()
    monkeypatch.setattr(builtins, "__import__", real_import)
    out, err = capsys.readouterr()
    assert info.value.code == 130 and err == "interrupted\n" and out == "" and called == [True]


def test_which_failures_are_the_users():
    def in_frame(path):  # an OSError without a file name, raised where `path` is being written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as info:
        in_frame("/data/runs/summary.json")
    assert (
        user_error_line(info.value)
        == f"no space left to write /data/runs/summary.json: [Errno {errno.ENOSPC}] "
        f"{os.strerror(errno.ENOSPC)}"
    )
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.csv")
    assert (
        user_error_line(missing) == "cannot access /data/x.csv: [Errno 2] No such file or directory"
    )
    package_file = FileNotFoundError(
        errno.ENOENT, "No such file or directory", str(Path(__file__).parents[1] / "p4bench" / "x")
    )
    assert user_error_line(package_file) is None  # a file of p4bench itself: a bug
    assert (
        user_error_line(OSError("cannot write mode RGBA as JPEG")) is None
    )  # a library's own message
    assert user_error_line(sqlite3.IntegrityError("UNIQUE constraint failed")) is None
    assert user_error_line(RuntimeError("x")) is None and user_error_line(KeyError("x")) is None
    assert user_error_line(UsageError("two\nlines")) == "two lines"


# -- up-front checks -------------------------------------------------------------------------------


def test_check_run_paths(tmp_path, monkeypatch):
    from p4bench.config import RunConfig
    from p4bench.run.preflight import check_output_file, check_run_paths

    (tmp_path / "afile").write_text("")
    with pytest.raises(UsageError, match="afile is a file, not a folder"):
        check_run_paths(RunConfig(results_dir=str(tmp_path / "afile" / "sub")))
    with pytest.raises(UsageError, match=r"MLflow store sqlite:///.*afile/mlflow\.db"):
        check_run_paths(
            RunConfig(
                results_dir=str(tmp_path / "ok"),
                tracking_uri=f"sqlite:///{tmp_path}/afile/mlflow.db",
            )
        )
    with pytest.raises(UsageError, match="is a folder, not a database file"):
        check_run_paths(
            RunConfig(results_dir=str(tmp_path / "ok"), tracking_uri=f"sqlite:///{tmp_path}")
        )
    check_run_paths(
        RunConfig(
            results_dir=str(tmp_path / "ok" / "deeper"),
            tracking_uri=f"sqlite:///{tmp_path}/db/m.db",
        )
    )
    assert (tmp_path / "ok" / "deeper").is_dir() and (
        tmp_path / "db"
    ).is_dir()  # made, as the run would
    assert (
        sorted(p.name for p in (tmp_path / "ok" / "deeper").iterdir()) == []
    )  # the write probe is gone
    with pytest.raises(UsageError, match="it is a folder"):
        check_output_file(tmp_path, "tuned config")
    check_output_file(tmp_path / "new" / "tuned.yaml", "tuned config")
    assert not (tmp_path / "new").exists()  # an output file's folder is probed, not made

    full = os.statvfs_result((4096, 4096, 1000, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    with pytest.raises(UsageError, match="no space left for the results folder"):
        check_run_paths(RunConfig(results_dir=str(tmp_path / "ok")))


@pytest.mark.parametrize(
    "uri, says",
    [
        ("sqllite:///typo.db", "unknown scheme 'sqllite:'"),
        ("foo://bar", "unknown scheme 'foo:'"),
        ("htp://127.0.0.1:5000", "unknown scheme 'htp:'"),
        ("runs/folder-store", "folder store"),
        ("file:///tmp/p4bench-folder-store", "folder store"),
    ],
)
def test_a_tracking_uri_mlflow_would_refuse_is_one_line_before_any_training(
    capsys, tmp_path, uri, says
):
    code, _, err = invoke(
        ["run", "--rounds", "1", "--results-dir", str(tmp_path), "--tracking-uri", uri], capsys
    )
    assert code == 2 and says in one_error_line(err) and "Traceback" not in err


def test_the_tracking_schemes_are_mlflows(monkeypatch, tmp_path):
    from mlflow.store.db.db_types import DATABASE_ENGINES
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    from p4bench.run.preflight import TRACKING_SCHEMES, check_tracking_uri

    assert set(TRACKING_SCHEMES) == set(_tracking_store_registry._registry) | set(DATABASE_ENGINES)
    check_tracking_uri(
        "postgresql+psycopg2://user@127.0.0.1/db"
    )  # a database with its driver: left to MLflow
    check_tracking_uri("http://127.0.0.1:5000")
    monkeypatch.setenv(
        "MLFLOW_ALLOW_FILE_STORE", "true"
    )  # MLflow's own opt-in keeps folder stores usable
    check_tracking_uri(str(tmp_path))


@pytest.mark.parametrize(
    "args, says",
    [
        (["run", "--rounds", "abc"], "Invalid value for '--rounds'"),
        (["run", "--seed", "abc"], "Invalid value for '--seed'"),
        (["runn"], "No such command 'runn'. Did you mean 'run'?"),
        (["run", "--bogus-flag"], "No such option: --bogus-flag"),
    ],
)
def test_click_usage_errors_are_one_line_and_exit_2(capsys, args, says):
    code, _, err = invoke(args, capsys)
    assert code == 2 and says in one_error_line(err) and "--help" in err and "Usage:" not in err


def test_flags_show_no_value_type_in_help(capsys):
    code, out, _ = invoke(["run", "--help"], capsys)
    rows = {line.split()[1]: line for line in out.splitlines() if line.strip().startswith("│ --")}
    assert code == 0 and "<bool>" not in rows["--json"] and "<bool>" not in rows["--no-dp"]
    assert "<int>" in rows["--rounds"]  # options that take a value still say which


# -- --version and completion ------------------------------------------------------------------


def test_version_is_printed_without_building_the_app():
    code = (
        "import sys\nfrom p4bench.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'mlflow', 'p4bench.host.manager') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900
    )  # a hang guard, not a limit on the work
    assert done.returncode == 0, done.stderr
    from importlib.metadata import version

    assert done.stdout.strip() == f"p4bench {version('p4bench')}"


def test_help_lists_version_and_completion(capsys):
    code, out, _ = invoke(["--help"], capsys)
    assert code == 0
    for option in ("--version", "--install-completion", "--show-completion"):
        assert option in out


# -- reproduce --quick: a smoke run tests no claim --------------------------------------------------


def test_reproduce_quick_says_its_claims_are_not_tested(capsys, monkeypatch):
    import p4bench.studies.reproduce
    from p4bench.config import RunConfig
    from p4bench.studies.backends import RunRecord
    from p4bench.studies.claims import ClaimCheck
    from p4bench.studies.sweep import PlannedRun, SweepReport

    planned = [PlannedRun(RunConfig(rounds=3, seed=0), {})]
    sweep = SweepReport(
        "reproduce-x-digits-quick", "sqlite:///x.db", planned, [RunRecord("h", "finished", {})]
    )
    checks = [
        ClaimCheck("A beats B", "not tested", "quick smoke run; figures: A 70% vs B 60%"),
        ClaimCheck("partitioner claim", "no", "computed", training=False),
    ]
    report = SimpleNamespace(
        quick=True,
        dataset="digits",
        tuning=None,
        tuned_lr={},
        sweep=sweep,
        comparison=None,
        beside=None,
        extras=[],
        privacy=[],
        claims=checks,
    )
    monkeypatch.setattr(p4bench.studies.reproduce, "reproduce", lambda *args, **kwargs: report)
    code, out, _ = invoke(["reproduce", "privacy", "--quick"], capsys)
    assert code == 0
    lines = out.splitlines()
    header = lines.index("claims of the paper on digits (quick smoke run):")
    assert lines[header + 1].startswith(
        "smoke run (--quick: 3 rounds, 1 seed, shorter lists): not a test of the paper's claims"
    )
    assert "- A beats B: not tested (quick smoke run; figures: A 70% vs B 60%)" in lines
    assert (
        "- partitioner claim: no (computed) no training needed: a verdict even in a smoke run"
        in lines
    )


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens there once the probe is closed


@pytest.mark.parametrize("study", ["sweep", "tune", "reproduce"])
def test_a_ray_address_where_nothing_answers_is_one_line_before_any_run(capsys, tmp_path, study):
    address = f"127.0.0.1:{_closed_port()}"
    args = {
        "sweep": ["sweep", str(Path(__file__).resolve().parents[1] / "examples" / "grid.yaml")],
        "tune": [
            "tune",
            "--method",
            "fedavg",
            "--grid",
            "lr=0.1,0.5",
            "--output",
            str(tmp_path / "tuned.yaml"),
        ],
        "reproduce": ["reproduce", "heterogeneity", "--quick"],
    }[study]
    code, _, err = invoke(
        [*args, "--backend", "ray", "--address", address, "--results-dir", str(tmp_path)], capsys
    )
    line = one_error_line(err)
    assert (
        code == 2 and f"no Ray cluster answers at {address}" in line and "ray start --head" in line
    )
    assert not list(tmp_path.glob("*/config.yaml"))  # nothing ran


def test_a_malformed_ray_address_is_one_line(capsys, tmp_path):
    grid = str(Path(__file__).resolve().parents[1] / "examples" / "grid.yaml")
    code, _, err = invoke(
        [
            "sweep",
            grid,
            "--backend",
            "ray",
            "--address",
            "head-node",
            "--results-dir",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == 2 and "--address must be HOST:PORT" in one_error_line(err)
