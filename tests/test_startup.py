"""Start-up stays light (issue 21, part 4): building the command line imports no torch,
lazily re-exported names resolve to their definitions, the process-wide registry calls
no hook until used, and the start-up shortcuts (digits without scikit-learn, a new MLflow
store copied from a migrated template) give what the slow paths give."""

from __future__ import annotations

import importlib
import json
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

HEAVY = ("torch", "scipy", "mlflow", "pandas", "sklearn", "kymatio", "matplotlib")

LAZY_MODULES = (  # packages re-exporting their submodules' names, and hook modules the names they used to import
    "p4bench.engine",
    "p4bench.data",
    "p4bench.privacy",
    "p4bench.topology",
    "p4bench_baselines",
    "p4bench_attacks",
    "p4bench_defenses",
    "p4bench_p4",
    "p4bench_p4l",
    "p4bench_device",
    "p4bench.engine.runtimes",
    "p4bench.data.builtin",
    "p4bench.privacy.builtin",
    "p4bench.topology.builtin",
)


def _in_fresh_interpreter(code: str) -> object:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_imports_no_heavy_library():
    """`p4bench --help` builds the app, its plugin manager and the built-in commands."""
    loaded = _in_fresh_interpreter(
        "import contextlib, io, json, sys\n"
        "from p4bench.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    assert loaded == [], f"`p4bench --help` imports {loaded}: import them where they are used"


def test_default_registry_calls_no_hook_until_used():
    result = _in_fresh_interpreter(
        "import json, sys\n"
        "from p4bench.host.manager import default_registry\n"
        "registry = default_registry()\n"
        "problems = registry.problems\n"
        "before = 'torch' in sys.modules\n"
        "names = registry.names('method')\n"
        "print(json.dumps([len(problems), before, 'fedavg' in names, 'torch' in sys.modules]))\n"
    )
    assert result == [0, False, True, True]


@pytest.mark.parametrize("name", LAZY_MODULES)
def test_lazy_exports_are_the_defined_objects(name):
    module = importlib.import_module(name)
    assert module.__all__
    for export in module.__all__:
        value = getattr(module, export)
        defined_in = getattr(value, "__module__", None)
        if defined_in and defined_in.startswith("p4bench") and isinstance(value, type):
            assert getattr(importlib.import_module(defined_in), value.__name__) is value
        assert export in dir(module)  # once imported
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_from_imports_and_submodules_still_work():
    from p4bench.engine import Method
    from p4bench.engine.runtime import SimulationRuntime as runtime
    from p4bench.engine.runtimes import SimulationRuntime
    from p4bench.privacy import BUILTIN_ACCOUNTANTS, Accountant
    from p4bench_baselines import FedAvg
    from p4bench_baselines.fedavg import FedAvg as defined

    assert FedAvg is defined and issubclass(FedAvg, Method)
    assert SimulationRuntime is runtime
    assert all(issubclass(cls, Accountant) for cls in BUILTIN_ACCOUNTANTS)
    assert importlib.import_module("p4bench.engine").driver.__name__ == "p4bench.engine.driver"


def test_digits_read_without_scikit_learn_are_load_digits():
    from sklearn.datasets import load_digits

    from p4bench.data.digits import _bundled_digits

    images, target = _bundled_digits()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert target.dtype == bunch.target.dtype and np.array_equal(target, bunch.target)


# -- the MLflow store template ------------------------------------------------------------


def _schema(path) -> dict[str, list[str]]:
    """Each table, index and trigger's definition as sorted lines: MLflow's own migrations
    order a table's constraints differently from one store to the next."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL")
        return {
            name: sorted(line.strip().rstrip(",") for line in sql.splitlines())
            for name, sql in rows
        }


def _rows(path, query: str) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return list(db.execute(query))


def test_a_seeded_store_is_a_fresh_store(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from p4bench.tracking.store import seed_sqlite_store, template_path

    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(
        tmp_path
    )  # MLflow puts the Default experiment's artifacts under the working folder
    (tmp_path / "fresh").mkdir()
    (tmp_path / "seeded").mkdir()
    fresh, seeded = tmp_path / "fresh" / "mlflow.db", tmp_path / "seeded" / "mlflow.db"

    assert seed_sqlite_store(f"sqlite:///{seeded}")
    template = template_path()
    assert template is not None and template.is_file()
    clients = {path: MlflowClient(tracking_uri=f"sqlite:///{path}") for path in (fresh, seeded)}
    for client in clients.values():
        assert client.create_experiment("p4bench") == "1"
        default = client.get_experiment("0")
        assert (default.name, default.artifact_location) == (
            "Default",
            str(tmp_path / "mlruns" / "0"),
        )
    assert _schema(seeded) == _schema(fresh)
    for query in (
        "SELECT version_num FROM alembic_version",
        "SELECT * FROM workspaces",
        "SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments",
    ):
        assert _rows(seeded, query) == _rows(fresh, query)

    # the template is made once and reused; an existing store is never touched
    made = template.stat().st_mtime_ns
    again = tmp_path / "again.db"
    assert seed_sqlite_store(f"sqlite:///{again}")
    assert template.stat().st_mtime_ns == made
    before = seeded.read_bytes()
    assert not seed_sqlite_store(f"sqlite:///{seeded}")
    assert seeded.read_bytes() == before


def test_a_store_that_cannot_be_seeded_is_left_to_mlflow(tmp_path, monkeypatch):
    from p4bench.tracking.store import seed_sqlite_store, template_path

    monkeypatch.setenv("P4BENCH_CACHE_DIR", str(tmp_path / "cache"))
    for uri in (
        "http://localhost:5000",
        "sqlite:///:memory:",
        f"sqlite:///{tmp_path}/x.db?timeout=5",
        f"sqlite:///{tmp_path}/missing/mlflow.db",
        "file:///tmp/mlruns",
    ):
        assert not seed_sqlite_store(uri)
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "missing").exists()

    template = template_path()
    assert template is not None
    template.parent.mkdir(parents=True)
    template.write_text("not a database")  # a broken template is made again
    assert seed_sqlite_store(f"sqlite:///{tmp_path}/mlflow.db")
    assert _rows(tmp_path / "mlflow.db", "SELECT count(*) FROM experiments") == [(0,)]
