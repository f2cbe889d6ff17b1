"""CHANGELOG.md is built from `changes/` (scripts/changelog.py): the repository's is current,
a stale one is detected, fragments are grouped by section, a bad fragment is refused with
exit 2 and nothing written, and a release folds the fragments into a released section."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("changelog", ROOT / "scripts" / "changelog.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


changelog = _script()


def _tree(
    tmp_path: Path, fragments: dict[str, str], released: str = "", unreleased: str = ""
) -> Path:
    changes = tmp_path / "changes"
    changes.mkdir()
    for name, text in fragments.items():
        (changes / name).write_text(text)
    if released:
        (changes / "released.md").write_text(released)
    if unreleased:
        (changes / "unreleased.md").write_text(unreleased)
    return tmp_path


def run(root: Path, *args: str) -> int:
    return changelog.main([*args, "--root", str(root)])


RELEASED = "## 0.1.0 (2026-11-21)\n\nThe first version.\n"


def test_the_repository_changelog_is_what_its_fragments_build(capsys):
    code = changelog.main(["--check"])
    assert code == 0, capsys.readouterr().err + " (run python scripts/changelog.py)"
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "\n## Unreleased\n" in text
    assert text.index("## Unreleased") < text.index("## 0.1.0")


def test_fragments_are_grouped_by_section_in_order_with_their_issue(tmp_path):
    root = _tree(
        tmp_path,
        {
            "7-late-fix.md": "section: Fixed\n\nA fix\nover two lines.\n",
            "3-new-thing.md": "section: Added\n\n- A new thing.\n",
            "12-old-path.md": "section: Deprecated\n\nThe old path warns.\n",
            "2-early-fix.md": "section: Fixed\n\nAn earlier fix.\n",
        },
        released=RELEASED,
        unreleased="### Recorded before fragments\n\nOld text.\n",
    )
    assert run(root) == 0
    text = (root / "CHANGELOG.md").read_text()
    order = [
        "## Unreleased",
        "### Added",
        "- A new thing. (#3)",
        "### Deprecated",
        "- The old path warns. (#12)",
        "### Fixed",
        "- An earlier fix. (#2)",
        "- A fix\n  over two lines. (#7)",
        "### Recorded before fragments",
        "Old text.",
        "## 0.1.0 (2026-11-21)",
        "The first version.",
    ]
    positions = [text.index(part) for part in order]
    assert positions == sorted(positions)
    assert "### Changed" not in text  # no empty sections
    assert run(root, "--check") == 0


def test_check_detects_a_stale_changelog(tmp_path, capsys):
    root = _tree(tmp_path, {"5-a.md": "section: Changed\n\nOne change.\n"}, released=RELEASED)
    assert run(root) == 0
    assert run(root, "--check") == 0
    (root / "changes" / "6-b.md").write_text("section: Fixed\n\nAnother change.\n")
    assert run(root, "--check") == 1
    assert "not what changes/ builds" in capsys.readouterr().err
    assert run(root) == 0 and run(root, "--check") == 0
    (root / "CHANGELOG.md").write_text((root / "CHANGELOG.md").read_text() + "hand-edited\n")
    assert run(root, "--check") == 1


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("45-x.md", "section: Improved\n\nSomething.\n", "unknown section 'Improved'"),
        ("45-x.md", "Something without a section line.\n", "the first line must be"),
        ("45-x.md", "section: Fixed\n\n\n", "is empty"),
        ("45-x.md", "section: Fixed\n\n- one\n- two\n", "one change per fragment"),
        ("45-x.md", "section: Fixed\n\n## A heading\n", "no heading"),
        ("readme-front-door.md", "section: Fixed\n\nSomething.\n", "<issue>-<slug>.md"),
        ("45_Front_Door.md", "section: Fixed\n\nSomething.\n", "<issue>-<slug>.md"),
    ],
)
def test_a_bad_fragment_is_refused_with_exit_2_and_nothing_written(
    tmp_path, capsys, name, text, says
):
    root = _tree(
        tmp_path, {"1-good.md": "section: Added\n\nFine.\n", name: text}, released=RELEASED
    )
    assert run(root) == 2
    err = capsys.readouterr().err
    assert says in err and name in err
    assert not (root / "CHANGELOG.md").exists()
    assert run(root, "--check") == 2


def test_release_folds_the_fragments_into_a_released_section(tmp_path):
    root = _tree(
        tmp_path,
        {"8-thing.md": "section: Added\n\nA thing.\n"},
        released=RELEASED,
        unreleased="Before fragments.\n",
    )
    assert run(root, "--release", "0.2.0", "--date", "2026-12-24") == 0
    released = (root / "changes" / "released.md").read_text()
    assert (
        released.index("## 0.2.0 (2026-12-24)")
        < released.index("### Added")
        < released.index("- A thing. (#8)")
    )
    assert released.index("Before fragments.") < released.index("## 0.1.0 (2026-11-21)")
    assert sorted(p.name for p in (root / "changes").iterdir()) == ["released.md", "unreleased.md"]
    text = (root / "CHANGELOG.md").read_text()
    assert "## Unreleased\n\nNothing yet." in text and "## 0.2.0 (2026-12-24)" in text
    assert run(root, "--check") == 0
    assert run(root, "--release", "0.2.0", "--date", "2026-12-25") == 2  # released already
    assert run(root, "--release", "two") == 2
