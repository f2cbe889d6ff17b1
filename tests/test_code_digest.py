"""`p4bench.privacy.code_digest`: a digest of all the code of a method's plugin, so that a
verdict cached for a method goes stale when any of its modules (or p4bench) changes."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

from p4bench.privacy import code_digest as cd
from p4bench.privacy.code_digest import code_digest, code_files

HELPER = "SHARE = 0.0  # the part of the private model the method sends\n"
METHOD = "from .helper import SHARE\n\n\nclass Method:\n    share = SHARE\n"


class LocalMethod:
    """A method class defined in a test module: no distribution provides it."""


def _write_package(root: Path, name: str) -> Path:
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text(HELPER)
    (package / "method.py").write_text(METHOD)
    return package


def _age(folder: Path, seconds: int = 100) -> None:
    """Files older than the digest's two-second window, so that their stamp is trusted."""
    stamp = time.time_ns() - seconds * 1_000_000_000
    for path in folder.rglob("*"):
        os.utime(path, ns=(stamp, stamp))


@pytest.fixture
def package_name():
    """A fresh import name, unloaded after the test."""
    name = f"cd_plugin_{uuid.uuid4().hex[:10]}"
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


@pytest.fixture
def outside(tmp_path, monkeypatch, package_name):
    """An outside package on sys.path (no distribution): its class in pkg/method.py imports pkg/helper.py."""
    site = tmp_path / "site"
    package = _write_package(site, package_name)
    _age(package)
    monkeypatch.syspath_prepend(str(site))
    module = importlib.import_module(f"{package_name}.method")
    return types.SimpleNamespace(site=site, package=package, cls=module.Method)


def test_editing_a_helper_module_changes_the_digest_of_the_method(outside):
    first = code_digest(outside.cls)
    hits = cd._content_digest.cache_info().hits
    assert code_digest(outside.cls) == first and len(first) == 24 and int(first, 16) >= 0
    assert cd._content_digest.cache_info().hits > hits  # the second call read no file

    (outside.package / "helper.py").write_text(
        HELPER.replace("0.0", "0.1")
    )  # same size, older mtime
    _age(outside.package, seconds=50)
    edited = code_digest(outside.cls)
    assert edited != first


def test_an_edit_within_the_clock_tick_of_the_last_one_is_seen(outside):
    """A young file's stamp is not trusted: an edit that keeps its mtime, size and inode
    (two writes within one tick of the file system's clock) still changes the digest."""
    helper = outside.package / "helper.py"
    now = time.time_ns()
    os.utime(helper, ns=(now, now))
    before = code_digest(outside.cls)
    helper.write_text(HELPER.replace("0.0", "0.2"))
    os.utime(helper, ns=(now, now))
    assert code_digest(outside.cls) != before


def test_the_method_covers_every_file_of_its_package_and_nothing_outside(outside):
    files = set(code_files(outside.cls))
    assert {p.resolve() for p in outside.package.glob("*.py")} <= files
    assert not any("__pycache__" in p.parts for p in files)  # the import compiled the modules

    before = code_digest(outside.cls)
    (outside.site / "notes.txt").write_text("unrelated")
    (outside.site / "unrelated_module.py").write_text("X = 1\n")
    (outside.site.parent / "README.md").write_text("unrelated")
    assert code_digest(outside.cls) == before


def test_a_data_file_of_the_package_counts(outside):
    before = code_digest(outside.cls)
    (outside.package / "weights.json").write_text("[0.1]")
    assert code_digest(outside.cls) != before


def test_a_built_in_method_covers_the_whole_of_p4bench_and_is_stable():
    from p4bench_baselines.fedavg import FedAvg

    first = code_digest(FedAvg)
    assert code_digest(FedAvg) == first
    files = set(code_files(FedAvg))
    for package in (
        "p4bench",
        "p4bench.privacy",
        "p4bench_p4",
        "p4bench_device",
        "p4bench_baselines",
        "p4bench_attacks",
        "p4bench_defenses",
    ):
        spec = importlib.util.find_spec(package)  # each source root of the p4bench distribution
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).resolve() in files, package
    assert Path(sys.modules["p4bench_baselines.fedavg"].__file__).resolve() in files


def test_another_process_elsewhere_gets_the_same_digest(tmp_path):
    """A cache key: the same in every process (another working directory, other modules imported)."""
    from p4bench_baselines.fedavg import FedAvg

    script = (
        "from p4bench_baselines.fedavg import FedAvg; "
        "from p4bench.privacy.code_digest import code_digest; print(code_digest(FedAvg))"
    )
    before = code_digest(FedAvg)
    other = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, check=True, capture_output=True, text=True
    ).stdout.strip()
    assert other in (before, code_digest(FedAvg))  # (the tree may have been edited meanwhile)


def _change_file(monkeypatch, target: Path) -> None:
    """One file of p4bench's tree changes, as seen by the digest (the real tree is left as it is)."""
    target = target.resolve()
    read, stat = cd._read, cd._stat
    monkeypatch.setattr(
        cd,
        "_read",
        lambda path: b"# edited\n" + (read(path) or b"") if Path(path) == target else read(path),
    )
    monkeypatch.setattr(
        cd,
        "_stat",
        lambda path: (stat(path)[0] + 1, *stat(path)[1:]) if Path(path) == target else stat(path),
    )


def test_a_change_of_p4bench_s_tree_changes_built_in_and_outside_digests(monkeypatch, outside):
    from p4bench_baselines.fedavg import FedAvg

    built_in, plugin = code_digest(FedAvg), code_digest(outside.cls)
    helper = Path(sys.modules["p4bench.privacy.code_digest"].__file__).with_name("noise.py")
    _change_file(monkeypatch, helper)
    assert code_digest(FedAvg) != built_in
    assert code_digest(outside.cls) != plugin  # the host's code is folded into every digest


def test_a_change_of_the_method_s_own_module_in_p4bench_changes_its_digest(monkeypatch):
    from p4bench_baselines.fedavg import FedAvg

    before = code_digest(FedAvg)
    _change_file(monkeypatch, Path(sys.modules[FedAvg.__module__].__file__))
    assert code_digest(FedAvg) != before


def test_p4bench_s_version_is_folded_in(monkeypatch, outside):
    before = code_digest(outside.cls)
    monkeypatch.setattr(cd, "__version__", "99.0.0")
    assert code_digest(outside.cls) != before


def test_a_class_of_a_test_module_gets_a_digest_of_its_file():
    assert len(code_digest(LocalMethod)) == 24
    assert Path(__file__).resolve() in code_files(LocalMethod)

    class Inner:
        pass

    assert code_digest(Inner) == code_digest(LocalMethod)  # the same module, the same code


def test_an_object_without_a_file_gets_a_digest_of_its_byte_code():
    def make(body: str) -> type:
        namespace: dict[str, object] = {"__name__": "cd_no_such_module"}
        exec(f"class Method:\n    def share(self):\n        return {body}\n", namespace)
        return namespace["Method"]  # type: ignore[return-value]

    assert code_files(make("0.0")) == []
    assert code_digest(make("0.0")) == code_digest(make("0.0"))
    assert code_digest(make("0.0")) != code_digest(make("0.1"))
    assert len(code_digest(types.ModuleType("cd_unregistered_module"))) == 24
    assert len(code_digest(int)) == 24


def test_it_never_raises(monkeypatch):
    def broken(*args: object) -> None:
        raise RuntimeError("unreadable")

    monkeypatch.setattr(cd, "_collect", broken)
    first = code_digest(LocalMethod)
    assert (
        len(first) == 24 and code_digest(LocalMethod) != first
    )  # never found again: checked again


def _pyproject(dist: str, package: str) -> str:
    return (
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{dist}"\nversion = "0.1"\n\n[tool.setuptools]\npackages = ["{package}"]\n'
    )


def test_an_installed_distribution_is_hashed_as_installed(tmp_path, monkeypatch, package_name):
    source, site = tmp_path / "source", tmp_path / "site"
    _write_package(source, package_name)
    dist = package_name.replace("_", "-")
    (source / "pyproject.toml").write_text(_pyproject(dist, package_name))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    _age(site)
    monkeypatch.syspath_prepend(str(site))
    method = importlib.import_module(f"{package_name}.method").Method

    files = set(code_files(method))
    assert (site / package_name / "helper.py").resolve() in files
    assert any(p.name == "RECORD" and p.parent.name.endswith(".dist-info") for p in files)
    assert cd._collect(package_name, str(Path(sys.modules[method.__module__].__file__).resolve()))[
        0
    ] == [[dist, "0.1"]]

    before = code_digest(method)
    (source / package_name / "helper.py").write_text(
        HELPER.replace("0.0", "0.1")
    )  # not what was installed
    assert code_digest(method) == before
    (site / package_name / "helper.py").write_text(HELPER.replace("0.0", "0.1"))
    assert code_digest(method) != before


def test_an_editable_install_is_hashed_through_its_finder_mapping(
    tmp_path, monkeypatch, package_name
):
    """As setuptools' `pip install -e` writes it: a dist-info that lists a finder whose mapping
    names the source folders, one of them (package-dir) outside the package's folder."""
    source, site = tmp_path / "checkout", tmp_path / "site"
    package = _write_package(source, package_name)
    mapped = source / "extras"
    mapped.mkdir()
    (mapped / "__init__.py").write_text("")
    (mapped / "privacy.py").write_text("SEND = False\n")
    dist = package_name.replace("_", "-")
    info = site / f"{package_name}-0.3.dist-info"
    info.mkdir(parents=True)
    finder = f"__editable___{package_name}_0_3_finder.py"
    mapping = {package_name: str(package), f"{package_name}.extras": str(mapped)}
    (site / finder).write_text(
        f"MAPPING: dict[str, str] = {mapping!r}\nNAMESPACES: dict[str, list[str]] = {{}}\n"
    )
    (site / f"__editable__.{package_name}-0.3.pth").write_text(
        f"import __editable___{package_name}_0_3_finder\n"
    )
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "top_level.txt").write_text(package_name + "\n")
    (info / "direct_url.json").write_text(
        '{"dir_info": {"editable": true}, "url": "file:///checkout"}'
    )
    (info / "RECORD").write_text(
        f"{finder},,\n__editable__.{package_name}-0.3.pth,,\n{info.name}/RECORD,,\n"
    )
    _age(tmp_path)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(source))  # the import itself, without running the finder
    method = importlib.import_module(f"{package_name}.method").Method

    assert (mapped / "privacy.py").resolve() in set(
        code_files(method)
    )  # never imported, still covered
    assert cd._collect(package_name, None)[0] == [[dist, "0.3"]]
    before = code_digest(method)
    (mapped / "privacy.py").write_text("SEND = True\n")
    assert code_digest(method) != before


def test_a_cold_call_is_fast():
    from p4bench_baselines.fedavg import FedAvg

    cd.clear_cache()
    start = time.perf_counter()
    code_digest(FedAvg)
    assert (
        time.perf_counter() - start < 5.0
    )  # about 0.05 s on a laptop-class core for p4bench's ~300 files
