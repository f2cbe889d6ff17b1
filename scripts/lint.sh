#!/usr/bin/env bash
# Lint (ruff check, ruff format --check) and type-check (mypy) the code, as `.ci/run` does before
# the tests; settings in pyproject.toml. Arguments are passed on to mypy.
#
# mypy checks the host package and every built-in plugin package where it lies: each plugin folder
# is a source root (pyproject's mypy_path), so its report names the files of the work tree.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(cd "${P4BENCH_VENV:-.venv}" && pwd)"
status=0
"$venv/bin/ruff" check --output-format concise . || status=1
"$venv/bin/ruff" format --check --quiet . || { echo "ruff format: the files above need formatting (run: ruff format .)"; status=1; }
# P4BENCH_MYPY_CACHE lets two checks run side by side without sharing a cache.
cache="${P4BENCH_MYPY_CACHE:-.mypy_cache}"
packages=(-p p4bench)
for root in plugins baselines attacks defenses; do
  for package in "$root"/p4bench_*/; do
    packages+=(-p "$(basename "$package")")
  done
done
"$venv/bin/mypy" --cache-dir "$cache" "${packages[@]}" "$@" || status=1
exit $status
