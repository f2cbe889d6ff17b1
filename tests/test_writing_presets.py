"""docs/writing-presets.md's package, installed as written, registers its preset and runs
through `p4bench reproduce --quick` (the page's code imports only `p4bench.api`)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from p4bench.host.manager import reset_default

PAGE = Path(__file__).resolve().parents[1] / "docs" / "writing-presets.md"


def _block(language: str) -> str:
    """The page's first fenced code block in `language`."""
    found = re.search(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    assert found, f"no {language} block in {PAGE.name}"
    return found.group(1)


@pytest.fixture
def installed_page_package(install_example, tmp_path):
    package = tmp_path / "p4bench-fedavg-vs-local"
    (package / "p4bench_fedavg_vs_local").mkdir(parents=True)
    (package / "pyproject.toml").write_text(_block("toml"))
    (package / "p4bench_fedavg_vs_local" / "__init__.py").write_text(_block("python"))
    install_example(package)
    yield package
    sys.modules.pop("p4bench_fedavg_vs_local", None)
    reset_default()


def test_the_page_imports_only_the_api():
    imports = [
        line for line in _block("python").splitlines() if line.startswith(("from ", "import "))
    ]
    assert imports and all(line.startswith("from p4bench.api import ") for line in imports)


def test_the_pages_preset_is_registered_and_listed(installed_page_package, capsys):
    from p4bench.cli import main
    from p4bench.studies.presets import presets

    preset = presets()["fedavg-vs-local"]
    assert preset.variants.__module__ == "p4bench_fedavg_vs_local"
    assert [v["label"] for v in preset.variants("digits", False)] == ["alpha 25%", "alpha 50%"]
    with pytest.raises(SystemExit) as info:
        main(["reproduce", "no-such-preset"])
    assert info.value.code == 2
    listed = capsys.readouterr().err.strip().splitlines()[-1]
    assert listed.startswith("error: unknown preset 'no-such-preset'; presets: ")
    assert "fedavg-vs-local" in listed.split("presets: ")[1].split(", ")


def test_the_pages_preset_runs_its_smoke_run(installed_page_package, verify_full, capsys, tmp_path):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            [
                "reproduce",
                "fedavg-vs-local",
                "--quick",
                "--no-tune",
                "--results-dir",
                str(tmp_path / "runs"),
            ]
        )
    captured = capsys.readouterr()
    assert (info.value.code or 0) == 0, captured.err[-3000:]
    out = captured.out + captured.err
    assert "DP-FedAvg (epsilon 8) beats non-private local training: not tested" in out
    assert re.search(r"alpha 50%: fedavg \d+\.\d%, local \d+\.\d%", out)


def test_a_presets_settings_may_set_its_seeds(install_example, tmp_path):
    """`Preset.settings` replaces the scale's settings, the seeds included."""
    from p4bench.studies.reproduce import plan_preset

    package = tmp_path / "p4bench-seeded"
    (package / "p4bench_seeded").mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        '[project]\nname = "p4bench-seeded"\nversion = "0.1.0"\n'
        '[project.entry-points.p4bench]\nseeded = "p4bench_seeded"\n'
    )
    (package / "p4bench_seeded" / "__init__.py").write_text(
        textwrap.dedent(
            """
            from p4bench.api import NON_PRIVATE, ClaimCheck, Preset, hookimpl

            PRESET = Preset(
                name="seeded",
                summary="local training at five seeds",
                datasets=("digits",),
                base=dict(NON_PRIVATE),
                variants=lambda dataset, quick: [{"label": "local", "method": "local"}],
                group_by=("variant",),
                claims=lambda table, context: [ClaimCheck("none", "not checked")],
                settings=lambda dataset, quick: {"seeds": (3, 4) if quick else (0, 1, 2, 3, 4)},
            )


            @hookimpl
            def register_presets():
                return [PRESET]
            """
        )
    )
    install_example(package)
    try:
        for quick, seeds in ((True, [3, 4]), (False, [0, 1, 2, 3, 4])):
            plan = plan_preset("seeded", quick=quick, check_data=False)
            assert sorted(run.config.seed for run in plan.runs) == seeds
    finally:
        sys.modules.pop("p4bench_seeded", None)
        reset_default()
