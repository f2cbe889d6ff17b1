"""Start-up cost of the command line, of a rejected input and the fixed cost of a run (issues 21 and 49).

    python bench/startup.py [--repeats 5] [--run-repeats 3] [--rounds 30] [--skip-run]

Prints one JSON object. Every figure is a median over fresh processes, started the way
a user starts them (the `p4bench` script next to this interpreter), with warm caches:
one untimed call of each command, and one untimed run, come first. `*_min_s` is the
fastest repeat and `*_cpu_s` the child's user + system CPU time: wall times on a shared
2-core machine grow with its load (`load_average_at_start` / `_at_end`), CPU times and
minima much less.

- `python_bare_s`, `python_torch_s`: this machine's bare interpreter start, and one that
  imports torch (what any torch program pays), beside the commands' figures;
- `help_s`, `version_s`, `list_s`: `p4bench --help`, `p4bench --version`, `p4bench list`
  (their exit codes are reported: a command that does not exist yet still gets timed);
- `help_with_plugin_s`: `p4bench --help` with a third-party plugin installed (the gossip
  example, whose module imports torch), installed as `pip install` would (a dist-info
  folder with its entry point, on PYTHONPATH here) after one untimed `p4bench list`;
- `run_*`: `p4bench run --method fedavg --rounds 30 --json` on digits (the defaults
  otherwise), with `--results-dir` a fresh temporary folder each time (so the MLflow store
  is created by the run: the worst case). The run executes in a child process whose only
  addition is a probe plugin, registered on the process-wide plugin manager before
  `p4bench.cli.main` runs; it records the wall clock at `run_started` (before the
  tracker's) and at each `round_finished`, with the round's `seconds` (training and
  communication as the driver measures them; evaluation excluded).

  * `run_fixed_cost_s`: process start -> end of the second round, minus both rounds'
    `seconds` and minus one round's steady overhead (the median, over later rounds, of
    the time between two rounds' ends beyond the later one's `seconds`): what a run costs
    before its first round trains (interpreter and imports, plugins, data and features,
    privacy calibration, the tracker's MLflow store and run, the first evaluation and its
    logging), including what the run waits for after its first round (the first
    checkpoint, which needs the MLflow run's id). The issue's target: under 3 s.
  * `run_first_round_end_s`: process start -> end of the first round, minus its
    `seconds` (the figure before the wait after the first round was counted).
  * `run_until_started_s`: process start -> `run_started` (data, plugins, calibration).
  * `run_total_s`, `run_total_cpu_s`, `run_train_s` (sum of the rounds' `seconds`), and
    `run_overhead_s` = total - train: the issue's "fixed cost" (15.7 s total, 6.1 s of
    training), which also counts every round's evaluation and logging and the end of
    the run (artifacts, plots).
  * `run_first_round_s` and `run_median_round_s`: the first round also pays one-off
    costs inside training (torch's first `torch.func.grad` imports torch._dynamo and
    sympy, about 0.8 s), counted as training here.

- `reject_method_s`, `reject_rounds_s`, `reject_threads_s`: a rejected input, `p4bench run
  --method no-such-method`, `--rounds -1` and `--threads 0` (exit code 2 expected,
  `*_exit_code`), and `reject_*_imports_torch`: whether the process that rejected it had
  imported torch (an untimed call with the same arguments, in an interpreter that reports
  `sys.modules`). The plugin listing cache is current (filled by the untimed calls).
- `*_ratio`: each command's median wall time over a bare interpreter start's
  (`python_bare_s`), and `*_cpu_ratio` its CPU time over the bare start's CPU time (CPU
  grows less with the machine's load than wall); for the run, `run_fixed_cost_ratio`,
  `run_first_round_end_ratio` and `run_until_started_ratio` (wall over the bare start's).
- `run_threads`: the torch threads the run reported it computed on (its `--json` line's
  `threads`), and `peak_rss_mb` the largest resident set of any child process.

A cache outside the run folder (the MLflow store template of `p4bench.tracking.store`,
where the tracker uses it) is filled by the untimed run; a machine's very first run pays
for it once (about 1 s more).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROBE = r"""
import json, os, sys, time
from p4bench.hookspecs import hookimpl
import p4bench.host.manager as plugin_manager

events = {"rounds": []}

class StartupProbe:
    @hookimpl(tryfirst=True)  # before the tracker's: its MLflow set-up is not counted here
    def run_started(self, run):
        events["run_started"] = time.time()

    @hookimpl
    def round_finished(self, run, report):
        events["rounds"].append([time.time(), float(report.seconds), report.phase, report.round])

# registered when the run builds its plugin manager: building it here would load the
# built-in plugins (and torch) before the command starts, which no user's run does
create = plugin_manager.create_plugin_manager

def create_with_probe(*args, **kwargs):
    manager = create(*args, **kwargs)
    manager.register(StartupProbe(), name="startup-probe")
    return manager

plugin_manager.create_plugin_manager = create_with_probe
from p4bench.cli import main
sys.argv = ["p4bench", *sys.argv[1:]]
try:
    main()
finally:
    with open(os.environ["P4BENCH_STARTUP_PROBE"], "w") as handle:
        json.dump(events, handle)
"""


REJECTIONS = {  # a bad input each: refused with one line and exit 2
    "reject_method": ["run", "--method", "no-such-method"],
    "reject_rounds": ["run", "--rounds", "-1"],
    "reject_threads": ["run", "--threads", "0"],
}

IMPORTS_TORCH = r"""
import sys
from p4bench.cli import main
sys.argv = ["p4bench", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
finally:
    print("torch" in sys.modules)
"""


def imports_torch(argv: list[str]) -> bool:
    """Whether `p4bench ARGV` had imported torch by the time it exited."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_TORCH, *argv], capture_output=True, text=True, check=False
    )
    return done.stdout.strip().splitlines()[-1:] == ["True"]


def _script() -> str:
    """The `p4bench` console script next to this interpreter."""
    script = Path(sys.executable).parent / "p4bench"
    return str(script) if script.exists() else shutil.which("p4bench") or "p4bench"


def _children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _with_example_plugin(site: Path) -> dict[str, str]:
    """The environment of a machine with examples/p4bench-gossip installed (its dist-info in `site`)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "p4bench-gossip"
    info = site / "p4bench_gossip-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: p4bench-gossip\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[p4bench]\ngossip = p4bench_gossip\n")
    paths = [str(site), str(example), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def time_command(
    argv: list[str], repeats: int, env: dict[str, str] | None = None
) -> dict[str, object]:
    """Median wall and CPU time of `argv` over `repeats` fresh processes, after one untimed call."""
    times, cpu, code = [], [], 0
    for attempt in range(repeats + 1):
        cpu_before = _children_cpu()
        started = time.perf_counter()
        done = subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False
        )
        elapsed = time.perf_counter() - started
        code = done.returncode
        if attempt:  # the first call warms the caches
            times.append(elapsed)
            cpu.append(_children_cpu() - cpu_before)
    return {
        "median_s": round(statistics.median(times), 3),
        "min_s": round(min(times), 3),
        "cpu_s": round(statistics.median(cpu), 3),
        "exit_code": code,
    }


def time_run(rounds: int, extra: list[str]) -> dict[str, float | None]:
    """One `p4bench run` in a child process with the probe plugin; see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="p4bench-startup-") as scratch:
        probe_file = Path(scratch) / "probe.json"
        env = {**os.environ, "P4BENCH_STARTUP_PROBE": str(probe_file)}
        argv = [
            sys.executable,
            "-c",
            PROBE,
            "run",
            "--method",
            "fedavg",
            "--rounds",
            str(rounds),
            "--results-dir",
            str(Path(scratch) / "results"),
            "--json",
            *extra,
        ]
        cpu_before = _children_cpu()
        started_wall = time.time()
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        total = time.perf_counter() - started
        cpu = _children_cpu() - cpu_before
        if done.returncode != 0:
            raise SystemExit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        events = json.loads(probe_file.read_text())
        summary = json.loads(done.stdout.strip().splitlines()[-1])
    rounds_seen = events["rounds"]
    if not rounds_seen or "run_started" not in events:
        raise SystemExit(
            "the probe saw no round: is the run still using the process-wide plugin manager?"
        )
    if len(rounds_seen) < 4:
        raise SystemExit("the run needs at least 4 rounds (--rounds)")
    first_end, first_seconds = rounds_seen[0][0], rounds_seen[0][1]
    ends, seconds = [r[0] for r in rounds_seen], [r[1] for r in rounds_seen]
    steady = statistics.median(ends[k] - ends[k - 1] - seconds[k] for k in range(2, len(ends)))
    train = sum(seconds)
    return {
        "run_fixed_cost_s": ends[1] - started_wall - seconds[0] - seconds[1] - steady,
        "run_first_round_end_s": first_end - started_wall - first_seconds,
        "run_until_started_s": events["run_started"] - started_wall,
        "run_total_s": total,
        "run_total_cpu_s": cpu,
        "run_train_s": train,
        "run_overhead_s": total - train,
        "run_first_round_s": first_seconds,
        "run_median_round_s": statistics.median(r[1] for r in rounds_seen),
        "run_rounds_reported": len(rounds_seen),
        "run_threads": summary.get("threads"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed calls of each command (median)"
    )
    parser.add_argument(
        "--run-repeats", type=int, default=3, help="timed runs (median of each figure)"
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--skip-run", action="store_true", help="only the commands, not a run")
    parser.add_argument(
        "--run-option",
        action="append",
        default=[],
        help="extra argument for `p4bench run` (repeatable)",
    )
    args = parser.parse_args()

    script = _script()
    result: dict[str, object] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "bytecode_cache_written": not os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "load_average_at_start": round(
            os.getloadavg()[0], 2
        ),  # other work on the machine inflates wall times
        "repeats": args.repeats,
    }
    # the machine's own start-up beside ours: a bare interpreter, and one that imports torch
    for label, argv in (
        ("python_bare", [sys.executable, "-c", "pass"]),
        ("python_torch", [sys.executable, "-c", "import torch"]),
    ):
        timing = time_command(argv, args.repeats)
        result[f"{label}_s"] = timing["median_s"]
        result[f"{label}_min_s"] = timing["min_s"]
        result[f"{label}_cpu_s"] = timing["cpu_s"]
    commands = {"help": ["--help"], "version": ["--version"], "list": ["list"], **REJECTIONS}
    for label, argv in commands.items():
        timing = time_command([script, *argv], args.repeats)
        result[f"{label}_s"] = timing["median_s"]
        result[f"{label}_min_s"] = timing["min_s"]
        result[f"{label}_cpu_s"] = timing["cpu_s"]
        result[f"{label}_exit_code"] = timing["exit_code"]
        if label in REJECTIONS:
            result[f"{label}_imports_torch"] = imports_torch(argv)
    with tempfile.TemporaryDirectory(prefix="p4bench-startup-site-") as site:
        env = _with_example_plugin(Path(site))
        subprocess.run(
            [script, "list"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            check=False,
        )
        timing = time_command([script, "--help"], args.repeats, env=env)
        result["help_with_plugin_s"] = timing["median_s"]
        result["help_with_plugin_min_s"] = timing["min_s"]
        result["help_with_plugin_exit_code"] = timing["exit_code"]
    if not args.skip_run:
        time_run(args.rounds, args.run_option)  # untimed: warms the caches (the run's own, too)
        runs = [time_run(args.rounds, args.run_option) for _ in range(args.run_repeats)]
        result["run_repeats"] = args.run_repeats
        result["run_rounds"] = args.rounds
        for key in runs[0]:
            if key == "run_threads":
                result[key] = runs[0][key]
                continue
            result[key] = round(statistics.median(float(r[key]) for r in runs), 3)
        for key in (
            "run_fixed_cost_s",
            "run_until_started_s",
            "run_total_s",
        ):  # the least disturbed run
            result[key[: -len("_s")] + "_min_s"] = round(min(float(r[key]) for r in runs), 3)
    add_ratios(result)
    result["peak_rss_mb"] = round(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1
    )  # the largest child (Linux: KiB)
    result["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


def add_ratios(result: dict[str, Any]) -> None:
    """`*_ratio` (wall) and `*_cpu_ratio` of the timed figures, to a bare interpreter start."""
    bare, bare_cpu = float(result["python_bare_s"]), float(result["python_bare_cpu_s"])
    labels = ("python_torch", "help", "version", "list", "help_with_plugin", *REJECTIONS)
    for label in (*labels, "run_fixed_cost", "run_first_round_end", "run_until_started"):
        if f"{label}_s" not in result:  # --skip-run
            continue
        result[f"{label}_ratio"] = round(float(result[f"{label}_s"]) / bare, 1) if bare else None
        cpu = result.get(f"{label}_cpu_s")
        if cpu is not None and bare_cpu:
            result[f"{label}_cpu_ratio"] = round(float(cpu) / bare_cpu, 1)


if __name__ == "__main__":
    main()
