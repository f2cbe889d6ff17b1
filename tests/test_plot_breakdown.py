"""scripts/plot_breakdown.py: the docs' breakdown figure is drawn from `compare --format csv`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_breakdown.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plot_breakdown", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reads_compare_csv_into_lines_per_graph_and_defense(tmp_path: Path) -> None:
    table = tmp_path / "table.csv"
    table.write_text(
        "options.topology,variant,defense,mean,std,n,ci95_half\n"
        '"""ring""",dissensus 25%,median,0.6,0.1,4,0.12\n'
        '"""ring""",no attack,median,0.8,0.05,4,0.05\n'
        '"""ring""",dissensus 12.5%,median,0.7,0.1,4,0.1\n'
        '"""torus""",no attack,none,0.81,0.0,1,nan\n'
    )
    script = _script()
    rows = script.read_rows(table, 16)
    assert rows[("ring", "median")] == [(0, 0.8, 0.05, 4), (2, 0.7, 0.1, 4), (4, 0.6, 0.12, 4)]
    assert rows[("torus", "none")] == [(0, 0.81, 0.0, 1)]  # one seed: no interval, not a crash
    out = script.plot(rows, tmp_path / "figure.png", 16)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
