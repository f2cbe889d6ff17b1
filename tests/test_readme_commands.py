"""Every `p4bench` command of the README's command blocks, and of the manual pages that took
over the README's command blocks (`RUN_PAGES`), runs as written, so no example can rot; the
README's first recipe ends in its comparison table; and the table of expected accuracies on
digits (docs/quickstart.md) holds.

- `test_readme_command`: each command of a fenced ```bash block, in process
  (`p4bench.cli.main`), in a scratch folder per block (so `compare` sees the block's
  `sweep`; earlier commands of a block run first), at small sizes: the flags of
  `small_sizes` are appended (click keeps an option's last value), nothing else changes.
  Only the commands of `CANNOT_RUN_HERE` are skipped, each with its reason; they are
  still parsed (`test_skipped_commands_parse`).
- `test_the_first_recipe_ends_in_a_comparison_table`: the README's block between
  `<!-- recipe:begin -->` and `<!-- recipe:end -->` (a sweep, then `compare`), as written
  plus the sweep's `small_sizes` flags (the one change: smaller runs), must print the
  comparison table with the rows of the README's printed table (`<!-- recipe-table:... -->`);
  `P4BENCH_README_RECIPE_FULL=1` runs it at full size and checks the means too. Those
  commands are covered there, so `test_readme_command` leaves them out.
- `test_expected_accuracy`: the table between `<!-- expected:begin -->` and
  `<!-- expected:end -->`; each row marked *tested* runs exactly as written (plus
  `--json`) and its accuracy must be within `TOLERANCE`. Those commands are covered
  there at full size, so `test_readme_command` leaves them out.
- `test_doc_page_commands_parse`: the `p4bench` commands of the other docs pages parse
  (subcommands, option names and types) without running.

The data folder is an empty scratch folder, so a preset that falls back to digits does so
here whatever `~/.cache/p4bench/data` holds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from p4bench.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The pages whose commands run: the README, and the manual pages that hold what was the
# README's manual (its command blocks moved there with it). The other pages' are parsed.
RUN_PAGES = (README,) + tuple(
    DOCS / name
    for name in (
        "running.md",
        "data.md",
        "results.md",
        "papers.md",
        "studies.md",
        "privacy-practice.md",
        "benchmarks.md",
    )
)
EXPECTED_PAGE = DOCS / "quickstart.md"  # the table of expected accuracies on digits
TOLERANCE = 0.03

# Commands that cannot run on a test machine: a prefix of the arguments after `p4bench`,
# and why. Keep this short; everything else runs.
CANNOT_RUN_HERE: dict[tuple[str, ...], str] = {
    (
        "device",
        "serve",
    ): "a peer serves until a launcher runs it: needs every peer of the peers file (docs/device.md)",
    (
        "device",
        "launch",
    ): "needs every peer of the peers file serving at its address (Raspberry Pis, docs/device.md)",
    (
        "run",
        "--config",
        "examples/configs/karras-table2.yaml",
    ): "needs CIFAR-10 files (`p4bench data download cifar10`, network)",
    ("--install-completion",): "writes the user's shell start-up files",
    (
        "sweep",
        "examples/grid.yaml",
        "--backend",
        "ray",
        "--address",
    ): "needs a Ray cluster and an MLflow server: "
    "tests/test_ray_cluster.py starts both on 127.0.0.1",
    ("run", "--method", "p4", "--model", "scatter-cnn", "--device", "cuda"): "needs a CUDA GPU",
}

# `reproduce NAME`: the runs kept at small size (`--only KEY=VALUE`), 3 to 5 of the preset's.
REPRODUCE_ONLY = {
    "heterogeneity": ["method=p4", "partitioner=shards"],
    "karras": ["method=p2p-fl"],
    "pdsl": ["method=pdsl"],
    "p4l": ["seed=0", "attack=none", "partitioner=iid"],
}

_FENCE = re.compile(r"^\s*```\s*([A-Za-z]*)\s*$")
_SHELL = {"bash", "sh", "shell", "console"}
_SEPARATORS = {"&&", "||", ";", "&", "|"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PLACEHOLDER = re.compile(r"^\[|\]$|^<.*>$|\.\.\.")


@dataclass(frozen=True)
class Command:
    """One `p4bench` invocation of a fenced shell block."""

    source: str  # file name
    block: int  # index of the fenced block in the file
    line: int  # 1-based line where the command starts
    argv: tuple[str, ...]  # arguments after `p4bench`
    env: tuple[tuple[str, str], ...] = field(default=())  # leading VAR=value assignments

    @property
    def text(self) -> str:
        return " ".join(["p4bench", *self.argv])

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}:{' '.join(self.argv[:2])}"


def fenced_segments(path: Path) -> list[tuple[int, int, tuple[tuple[str, str], ...], list[str]]]:
    """Every command of the shell blocks of a Markdown file as (block, line, environment,
    words): continuation lines joined, comments dropped, `a && b` split, leading
    `VAR=value` kept as environment."""
    segments_out, block, language, start, pending = [], -1, None, 0, ""
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        fence = _FENCE.match(raw)
        if fence:
            if language is None:
                block, language = block + 1, fence.group(1).lower()
            else:
                language = None
            continue
        if language not in _SHELL:
            continue
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, pending = pending + raw, ""
        tokens = shlex.split(line, comments=True)
        segments, current = [], []
        for token in tokens:
            if token in _SEPARATORS:
                segments.append(current)
                current = []
            else:
                current.append(token)
        segments.append(current)
        for segment in segments:
            env = []
            while segment and _ASSIGNMENT.match(segment[0]):
                key, _, value = segment.pop(0).partition("=")
                env.append((key, value))
            if segment:
                segments_out.append((block, start, tuple(env), segment))
    return segments_out


def fenced_commands(path: Path) -> list[Command]:
    """The `p4bench` commands of the shell blocks of a Markdown file (`fenced_segments`)."""
    return [
        Command(path.name, block, line, tuple(words[1:]), env)
        for block, line, env, words in fenced_segments(path)
        if Path(words[0]).name == "p4bench"
    ]


def cannot_run_here(command: Command) -> str | None:
    for prefix, reason in CANNOT_RUN_HERE.items():
        if command.argv[: len(prefix)] == prefix:
            return reason
    return None


def small_sizes(argv: tuple[str, ...]) -> list[str]:
    """The flags appended to make a README command cheap (the same command otherwise)."""
    sub = argv[0] if argv else ""
    if sub in ("run", "audit"):
        extra = ["--rounds", "1"]
        if "--local-peers" not in argv:
            extra += ["--clients", "8"]
        method = argv[argv.index("--method") + 1] if "--method" in argv else None
        if method == "p4l":
            extra += ["-o", "key_bits=512"]  # Paillier keys of 512 bits: the protocol, faster
        if method == "feddf":
            extra += ["-o", "distill_steps=10"]
        return extra
    if sub in ("sweep", "tune"):
        return ["--set", "rounds=1", "--set", "clients=8"]
    if sub == "reproduce":
        only = REPRODUCE_ONLY.get(argv[1] if len(argv) > 1 else "", [])
        # 10 clients: the presets' shards partitions need M * N / L to be an integer
        return [
            "--quick",
            "--no-tune",
            "--set",
            "rounds=1",
            "--set",
            "clients=10",
            *[a for kv in only for a in ("--only", kv)],
        ]
    return []


@dataclass
class Outcome:
    code: int
    out: str
    err: str


@contextlib.contextmanager
def _environment(cwd: Path, env: dict[str, str]):
    saved_cwd, saved_env = Path.cwd(), dict(os.environ)
    os.chdir(cwd)
    os.environ.update(env)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def invoke(argv: list[str], cwd: Path, env: dict[str, str]) -> Outcome:
    """`p4bench ARGV` in process, in `cwd`, with extra environment variables."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with _environment(cwd, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Outcome(code, out.getvalue(), err.getvalue())


def workspace(root: Path) -> Path:
    """A scratch folder with the repository's examples/ and an empty data folder."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "examples").exists():
        (root / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    (root / "data-empty").mkdir(exist_ok=True)
    return root


def _environment_of(command: Command, root: Path) -> dict[str, str]:
    return {"P4BENCH_DATA_DIR": str(root / "data-empty"), **dict(command.env)}


# -- the expected-accuracy table ------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    command: str
    accuracy: float
    proxy: float | None
    tested: bool


def expected_rows(text: str) -> list[Expected]:
    """The rows of the table between the `expected` markers of a Markdown text."""
    _, _, rest = text.partition("<!-- expected:begin -->")
    table, end, _ = rest.partition("<!-- expected:end -->")
    assert end, "no <!-- expected:begin --> ... <!-- expected:end --> table"
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        numbers = [float(x) for x in re.findall(r"\d+\.\d+", cells[1])]
        rows.append(
            Expected(
                cells[0].strip("`"),
                numbers[0],
                numbers[1] if len(numbers) > 1 else None,
                cells[-1] == "tested",
            )
        )
    return rows


def _between(path: Path, name: str) -> tuple[int, int]:
    """The 1-based lines of `<!-- name:begin -->` and `<!-- name:end -->` in a page."""
    lines = path.read_text().splitlines()
    return lines.index(f"<!-- {name}:begin -->") + 1, lines.index(f"<!-- {name}:end -->") + 1


README_COMMANDS = fenced_commands(README)
RUN_COMMANDS = [c for page in RUN_PAGES for c in fenced_commands(page)]
EXPECTED = expected_rows(EXPECTED_PAGE.read_text())
TESTED = {row.command for row in EXPECTED if row.tested}
_RECIPE_LINES = _between(README, "recipe")
RECIPE = [c for c in README_COMMANDS if _RECIPE_LINES[0] < c.line < _RECIPE_LINES[1]]


# -- the tests ------------------------------------------------------------------------------


def test_the_readme_has_commands_and_no_placeholders():
    assert len(RUN_COMMANDS) >= 30 and len(RECIPE) == 2
    for command in RUN_COMMANDS:
        odd = [token for token in command.argv if _PLACEHOLDER.search(token)]
        assert not odd, (
            f"{command.source} line {command.line}: {command.text!r} is not runnable as written ({odd})"
        )


SHELL_BUILTINS = {"source", ".", "export", "cd"}


def test_every_readme_command_resolves_in_the_activated_environment():
    """After the README's set-up line (`source .venv/bin/activate`), each command of each
    block is the environment's (`.venv/bin/X`, or X itself on PATH), a script of the
    repository, or a shell builtin: nothing a newcomer's shell would call "command not found"."""
    environment = ROOT / ".venv" / "bin"
    unresolved = []
    for page in RUN_PAGES:
        for _, line, _, words in fenced_segments(page):
            name = words[0]
            if name in SHELL_BUILTINS or (ROOT / name).is_file():
                continue
            if Path(name).parent == Path(".venv/bin") or "/" not in name:
                if (environment / Path(name).name).exists():
                    continue
            unresolved.append(f"{page.name} line {line}: {name}")
    assert not unresolved, unresolved
    assert "source .venv/bin/activate" in README.read_text()  # the set-up line the blocks rely on


def test_the_table_lists_readme_commands():
    texts = {command.text for command in RUN_COMMANDS}
    for row in EXPECTED:
        assert row.command in texts, (
            f"the expected-accuracy table lists {row.command!r}, which no command block of"
            f" {', '.join(page.name for page in RUN_PAGES)} has"
        )
    assert "p4bench run" in TESTED


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """Per README block: its scratch folder and the outcomes of the commands run so far."""
    return {"root": tmp_path_factory.mktemp("readme"), "done": {}}


def _run_small(command: Command, blocks) -> Outcome:
    done = blocks["done"]
    if command not in done:
        root = workspace(blocks["root"] / f"{command.source}-block-{command.block}")
        done[command] = invoke(
            [*command.argv, *small_sizes(command.argv)], root, _environment_of(command, root)
        )
    return done[command]


@pytest.mark.parametrize(
    "command",
    [c for c in RUN_COMMANDS if c.text not in TESTED and c not in RECIPE],
    ids=lambda c: c.id,
)
def test_readme_command(verify_full, command, blocks):
    reason = cannot_run_here(command)
    if reason:
        pytest.skip(reason)
    for earlier in RUN_COMMANDS:  # a block is a sequence: `compare` reads what `sweep` wrote
        if (
            earlier.source == command.source
            and earlier.block == command.block
            and earlier.line < command.line
            and not cannot_run_here(earlier)
        ):
            _run_small(earlier, blocks)
    outcome = _run_small(command, blocks)
    assert outcome.code == 0, (
        f"{command.text} (+ {' '.join(small_sizes(command.argv))}) exited {outcome.code}:\n{outcome.err[-3000:]}"
    )


@pytest.mark.parametrize(
    "row", [row for row in EXPECTED if row.tested], ids=lambda row: row.command
)
def test_expected_accuracy(row, tmp_path_factory):
    command = next(c for c in RUN_COMMANDS if c.text == row.command)
    root = workspace(tmp_path_factory.getbasetemp() / "expected")
    outcome = invoke([*command.argv, "--json"], root, _environment_of(command, root))
    assert outcome.code == 0, outcome.err[-3000:]
    summary = json.loads(outcome.out.strip().splitlines()[-1])
    assert summary["accuracy_mean"] == pytest.approx(row.accuracy, abs=TOLERANCE), row.command
    if row.proxy is not None:
        assert summary["accuracy_proxy_mean"] == pytest.approx(row.proxy, abs=TOLERANCE), (
            row.command
        )


def parse_only(argv: list[str]) -> None:
    """Parse `p4bench ARGV` down to its leaf command (options, types, choices) without
    running it; a usage error (unknown command or option, bad value) raises.

    Duck-typed: typer builds on click (a vendored copy in recent typer), and a group is
    whatever resolves subcommands."""
    import typer.main

    from p4bench.cli import build_app

    command = typer.main.get_command(build_app())
    try:
        ctx = command.make_context("p4bench", list(argv))
        while hasattr(command, "resolve_command"):
            rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
            assert rest, f"p4bench {' '.join(argv)}: no command"
            name, sub, args = command.resolve_command(ctx, rest)
            assert sub is not None, f"no command {name!r}"
            command, ctx = sub, sub.make_context(name, args, parent=ctx)
    except Exception as exc:
        if type(exc).__name__ == "Exit" and getattr(exc, "exit_code", None) == 0:
            return  # an eager option (--help, --version, ...) ends parsing
        raise


@pytest.mark.parametrize(
    "command", [c for c in RUN_COMMANDS if cannot_run_here(c)], ids=lambda c: c.id
)
def test_skipped_commands_parse(command, tmp_path):
    with _environment(workspace(tmp_path), {"HOME": str(tmp_path)}):
        parse_only(list(command.argv))


DOC_COMMANDS = [
    c for page in sorted(DOCS.glob("*.md")) if page not in RUN_PAGES for c in fenced_commands(page)
]


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=lambda c: c.id)
def test_doc_page_commands_parse(command, tmp_path):
    with _environment(workspace(tmp_path), {"HOME": str(tmp_path)}):
        parse_only(list(command.argv))


# -- the README's first recipe --------------------------------------------------------------

_ROW = re.compile(r"^[│|]\s*(?P<cells>.+?)\s*[│|]\s*$")


def comparison_rows(text: str) -> dict[tuple[str, ...], tuple[float, ...]]:
    """The rows of a printed `p4bench compare` table: (method, attack, defense, epsilon) ->
    (mean, std, n); the header must name those columns (the 95% interval's is skipped)."""
    lines = text.splitlines()
    header = next(line for line in lines if "method" in line and "mean" in line)
    names = [cell.strip() for cell in re.split(r"[┃|]", header) if cell.strip()]
    expected = ["method", "attack", "defense", "epsilon", "mean", "95% (t)", "std", "n"]
    assert names == expected, header
    rows = {}
    for line in lines:
        match = _ROW.match(line.strip())
        if match:
            cells = [cell.strip() for cell in re.split(r"[│|]", match["cells"])]
            del cells[5]  # the interval: +-half-width, or n=1: none
            numbers = tuple(float(x) if x != "-" else float("nan") for x in cells[4:])
            rows[tuple(cells[:4])] = numbers
    return rows


def test_the_recipe_config_is_the_example_file():
    import yaml

    first, last = _between(README, "recipe-config")
    block = README.read_text().splitlines()[first : last - 1]
    assert block[0] == "```yaml" and block[-1] == "```"
    shown = yaml.safe_load("\n".join(block[1:-1]))
    assert shown == yaml.safe_load((ROOT / "examples" / "first-comparison.yaml").read_text())
    assert "examples/first-comparison.yaml" in RECIPE[0].argv


def test_the_first_recipe_ends_in_a_comparison_table(verify_full, tmp_path):
    """The README's recipe as written; smaller runs unless P4BENCH_README_RECIPE_FULL=1."""
    full = os.environ.get("P4BENCH_README_RECIPE_FULL") == "1"
    root = workspace(tmp_path)
    outcomes = []
    for command in RECIPE:
        smaller = [] if full else small_sizes(command.argv)  # the one change: smaller runs
        # the README's table was printed in a terminal 100 columns wide (rich shortens names
        # in a narrower one)
        environment = {**_environment_of(command, root), "COLUMNS": "100"}
        outcome = invoke([*command.argv, *smaller], root, environment)
        assert outcome.code == 0, f"{command.text} exited {outcome.code}:\n{outcome.err[-3000:]}"
        outcomes.append(outcome)
    assert [c.argv[0] for c in RECIPE] == ["sweep", "compare"]
    printed = comparison_rows(outcomes[-1].out)
    first, last = _between(README, "recipe-table")
    shown = comparison_rows("\n".join(README.read_text().splitlines()[first : last - 1]))
    assert len(shown) == 6 and set(printed) == set(shown)
    assert all(row[-1] == 2 for row in printed.values())  # two seeds per row
    assert (root / "first-comparison.png").is_file()
    if full:  # CPU runs are reproducible from the seed: the README's figures
        for key, (mean, _std, _n) in shown.items():
            assert printed[key][0] == pytest.approx(mean, abs=TOLERANCE), key


def test_the_readme_links_resolve():
    """The front door's links into the manual (relative Markdown links) name existing files."""
    links = re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 15
    assert not [link for link in local if not (ROOT / link).exists()], local
