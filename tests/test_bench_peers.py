"""bench/peers.py: a tiny side-by-side run of p4bench and the opacus loop (the JSON lines,
the same partition, agreeing accuracies), the verdict when accuracies drift apart, the
process-tree memory it reads and its usage errors."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPT = BENCH / "peers.py"
SYSTEM_KEYS = {
    "system",
    "variant",
    "clients",
    "rounds",
    "round_s",
    "rounds_s",
    "cpu_s",
    "wall_s",
    "peak_rss_mb",
    "accuracy",
    "data_digest",
    "round_cpu_s",
    "rounds_cpu_s",
    "threads",
    "torch_threads",
    "load_1min",
}
RATIO_KEYS = {
    "round_time_ratio",
    "speedup",
    "memory_ratio",
    "cpu_ratio",
    "accuracy_gap",
    "accuracy",
}


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    # no wall-clock limit: the run takes what a busy machine gives it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=BENCH.parent,
        env=env,
    )


@pytest.fixture(scope="module")
def peers_module():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("peers")
    finally:
        sys.path.remove(str(BENCH))


def test_tiny_run_reports_each_system_and_agreeing_accuracies() -> None:
    result = run_bench("--clients", "4", "--rounds", "2", "--systems", "p4bench", "opacus-loop")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    systems = [line for line in lines if "system" in line]
    ratios = [line for line in lines if "ratios" in line]
    assert [(s["system"], s["variant"]) for s in systems] == [
        ("p4bench", "plain"),
        ("opacus-loop", "plain"),
        ("p4bench", "dp"),
        ("opacus-loop", "dp"),
    ]
    for line in systems:
        assert SYSTEM_KEYS <= set(line), SYSTEM_KEYS - set(line)
        assert (
            line["clients"] == 4
            and line["rounds"] == 2
            and len(line["rounds_s"]) == len(line["rounds_cpu_s"]) == 2
        )
        assert line["peak_rss_mb"] > 0 and line["cpu_s"] > 0 and 0 <= line["accuracy"] <= 1
    for variant in ("plain", "dp"):
        ours, loop = (s for s in systems if s["variant"] == variant)
        # the partition handed to the loop is the one p4bench's own run trained on
        assert ours["data_digest"] == loop["data_digest"]
        # two rounds on 4 MNIST clients learn well above chance (10 classes) in both systems
        assert min(ours["accuracy"], loop["accuracy"]) > 0.3
        (ratio,) = (r for r in ratios if r["ratios"] == variant)
        assert ratio["same_data"] is True and RATIO_KEYS <= set(ratio["opacus-loop"])
        gap = abs(ours["accuracy"] - loop["accuracy"])
        assert gap <= ratio["tolerance"], (variant, ours["accuracy"], loop["accuracy"])
        assert ratio["opacus-loop"]["accuracy"] == "agree"
        assert ratio["opacus-loop"]["accuracy_gap"] == pytest.approx(gap, abs=1e-4)
    summary = lines[-1]
    assert summary["benchmark"] == "peers" and {
        "threads",
        "wall_s",
        "cpu_s",
        "peak_rss_mb",
        "load_1min",
    } <= set(summary)


def test_accuracies_apart_by_more_than_the_tolerance_disagree(peers_module) -> None:
    def row(accuracy: float, digest: str = "d") -> dict:
        return {
            "round_s": 0.5,
            "round_cpu_s": 0.4,
            "peak_rss_mb": 100.0,
            "cpu_s": 2.0,
            "accuracy": accuracy,
            "data_digest": digest,
        }

    rows = {"p4bench": row(0.80), "opacus-loop": row(0.70), "flower": row(0.78, "other")}
    verdict = peers_module.compare(rows, 0.05, "plain", 10)
    assert verdict["opacus-loop"]["accuracy"] == "disagree"
    assert verdict["flower"]["accuracy"] == "agree"
    assert verdict["same_data"] is False  # a system that trained on other records is named


def test_tree_memory_counts_a_childs_own_process(peers_module) -> None:
    from peers_client import tree_cpu_s, tree_rss_mb  # on the path with the bench folder

    hold = "import sys; b = bytearray(200 * 2**20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        alone = tree_rss_mb(child.pid)
        assert alone > 150  # the 200 MB the child touched
        # this process's tree holds the child: more than the child alone
        assert tree_rss_mb(os.getpid()) > alone
        # the child's CPU (it built 200 MB) counts in this process's tree
        assert tree_cpu_s(os.getpid()) >= tree_cpu_s(child.pid) > 0
    finally:
        child.communicate("")


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--clients", "1"], ["--data-rate", "1.5"]])
def test_bad_input_is_one_line_and_exit_2(flags: list[str]) -> None:
    result = run_bench(*flags)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("peers.py:")
