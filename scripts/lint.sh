#!/usr/bin/env bash
# Lint (ruff) and type-check (mypy) the code, as `.ci/run` does before the tests; settings
# in pyproject.toml. Arguments are passed on to mypy.
#
# mypy does not follow setuptools' package-dir mapping (plugins/ is shipped as
# p4bench.plugins, baselines/ as p4bench.baselines, ...), so it checks a mirror of the
# package made of symbolic links, under build/mypy/ (ignored by git), in which those
# folders sit where they are installed; its report names the files of the work tree.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
venv="$(cd "${P4BENCH_VENV:-.venv}" && pwd)"
status=0
"$venv/bin/ruff" check --output-format concise . || status=1
# P4BENCH_MYPY_TREE / P4BENCH_MYPY_CACHE let two checks run side by side without sharing files.
tree="${P4BENCH_MYPY_TREE:-$root/build/mypy}"
cache="${P4BENCH_MYPY_CACHE:-$root/.mypy_cache}"
rm -rf "$tree"
mkdir -p "$tree/p4bench"
for f in p4bench/*; do
  [ "$(basename "$f")" = __pycache__ ] || ln -s "$root/$f" "$tree/p4bench/"
done
mapped=$("$venv/bin/python" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
for package, folder in dirs.items():
    if package.startswith("p4bench."):
        print(package.removeprefix("p4bench."), folder)
PY
)
sed_args=()
while read -r sub folder; do
  ln -s "$root/$folder" "$tree/p4bench/$sub"
  sed_args+=(-e "s#^p4bench/$sub/#$folder/#")
done <<< "$mapped"
cd "$tree"
"$venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$cache" -p p4bench "$@" | sed "${sed_args[@]}" || status=1
exit $status
