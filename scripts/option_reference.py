"""Rewrite the README's plugin option tables from the plugins' declared `options`.

    python scripts/option_reference.py          # rewrite README.md in place
    python scripts/option_reference.py --check  # exit 1 when README.md is stale

Only the built-in plugins are listed (installed third-party plugins are not loaded).
"""

from __future__ import annotations

import sys
from pathlib import Path

from p4bench.options import with_option_reference
from p4bench.plugin_manager import Registry, create_plugin_manager

README = Path(__file__).resolve().parents[1] / "README.md"


def main(argv: list[str]) -> int:
    text = README.read_text()
    updated = with_option_reference(text, Registry(create_plugin_manager(autoload=False)))
    if "--check" in argv:
        if updated != text:
            print(f"{README} is stale: run python scripts/option_reference.py", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        README.write_text(updated)
        print(f"rewrote the option tables in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
