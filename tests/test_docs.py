"""The MkDocs site: it builds in strict mode, its navigation names every page, the option
reference is the generated one, and the expected accuracies are the quickstart's alone.

(The docs pages' `p4bench` commands are parsed by tests/test_readme_commands.py.)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REQUIRED = {
    "index.md",
    "quickstart.md",
    "options.md",
    "privacy.md",
    "device.md",
    "method-authors.md",
    "dp-dpsgd.md",
}


def _nav_pages() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages: list[str] = []

    def walk(items):
        for item in items:
            for value in item.values() if isinstance(item, dict) else [item]:
                walk(value) if isinstance(value, list) else pages.append(value)

    walk(config["nav"])
    return pages


def test_the_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a limit on the work
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for page in _nav_pages():
        built = site / (
            "index.html" if page == "index.md" else Path(page).with_suffix("") / "index.html"
        )
        assert built.is_file(), f"{page} was not built"


def test_the_nav_lists_every_page_and_every_page_exists():
    pages = _nav_pages()
    assert set(pages) >= REQUIRED
    assert len(pages) == len(set(pages))
    for page in pages:
        assert (DOCS / page).is_file(), f"mkdocs.yml names {page}, which docs/ lacks"
    assert {p.name for p in DOCS.glob("*.md")} == set(pages), (
        "a page of docs/ is missing from the nav"
    )


def _option_reference_script():
    spec = importlib.util.spec_from_file_location(
        "option_reference", ROOT / "scripts" / "option_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_option_page_is_generated_from_the_declarations():
    from p4bench.host.manager import Registry, create_plugin_manager

    script = _option_reference_script()
    expected = script.options_page(Registry(create_plugin_manager(autoload=False)))
    assert (DOCS / "options.md").read_text() == expected, (
        "docs/options.md is stale: run python scripts/option_reference.py"
    )
    for heading in ("## Run options", "### Methods", "### Attacks", "### Defenses", "### Runtimes"):
        assert heading in expected
    assert "| `group_size` | `p4` |" in expected and "| `rounds` | 30 |" in expected


def _expected_table(text: str) -> str:
    _, _, rest = text.partition("<!-- expected:begin -->")
    table, end, _ = rest.partition("<!-- expected:end -->")
    assert end
    return table.strip()


def test_the_expected_table_is_the_quickstart_s_alone():
    """One copy, so none goes stale: tests/test_readme_commands.py runs its tested rows."""
    assert _expected_table((DOCS / "quickstart.md").read_text())
    pages = [ROOT / "README.md", *(p for p in DOCS.glob("*.md") if p.name != "quickstart.md")]
    assert not [p.name for p in pages if "<!-- expected:begin -->" in p.read_text()]
