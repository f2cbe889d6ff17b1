#!/usr/bin/env bash
# The whole GPU check in one go (a few minutes on one H100), every result as JSON in one folder:
#   1. pytest -m cuda                      -> DIR/pytest-cuda.log (and its last line in DIR/check.json)
#   2. bench/gpu.py (P4 linear and scatter-CNN at 260 and 2,080 clients, DP-FedAvg linear at 100,000)
#                                          -> DIR/gpu.json
#   3. one `p4bench run ... --model scatter-cnn --device cuda --json` per DP method family
#                                          -> DIR/runs.jsonl (one summary per line, or the error)
#   4. bench/gpu_agreement.py: CPU and CUDA runs of one seed, Philox noise on both -> DIR/agreement.json
#   5. optional (GPU_CHECK_PROFILE=1): bench/gpu_profile.py's tables -> DIR/profile/
#   DIR/check.json: every step's exit status and seconds. GPU_CHECK_BUNDLE=1 packs the logs
#   and tables into DIR/logs.tar.gz (the lent GPU machine returns at most 8 files).
# Usage: scripts/gpu-check.sh [DIR]   (default: gpu-check-results; $OUT on the lent GPU machine)
#
# It needs a CUDA GPU and `python3` with torch (GPU_CHECK_PYTHON picks another interpreter).
# The lent GPU machine has no registry: `scripts/gpu-wheels.sh` downloads the missing
# dependencies into .whl/ here; carry .whl and set GPU_CHECK_INSTALL=1 there, and they are
# unpacked (from GPU_CHECK_WHEELS, default .whl) into GPU_CHECK_SITE (default /tmp/p4bench-site), nothing written into the image's
# environment. p4bench itself runs from this checkout's source roots (put on PYTHONPATH; no
# build step). GPU_CHECK_DEVICE=cpu rehearses the whole script on a machine without a GPU
# (with GPU_CHECK_BENCH_ARGS=--quick): the CUDA tests skip, every other step runs.
# GPU_CHECK_FAMILIES="p4 fedavg" runs only those methods' families in step 3.
# GPU_CHECK_BENCH_ARGS="--private-precision fp32 tf32" also times P4's scatter-CNN with its
# private model in TF32 (about a minute more at 2,080 clients).
# Each step has its own time limit; a failing step is recorded and the next one still runs.
# The exit status is the number of failed steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-results}}"
mkdir -p "$out"
python="${GPU_CHECK_PYTHON:-python3}"
export PYTHONUNBUFFERED=1 P4BENCH_DISABLE_PLUGIN_AUTOLOAD=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
failed=0
steps=()

record() {  # record NAME STATUS SECONDS
  steps+=("{\"step\": \"$1\", \"status\": $2, \"seconds\": $3}")
  [ "$2" -eq 0 ] || failed=$((failed + 1))
  echo "== $1: exit $2 in $3 s" >&2
}

timed() {  # timed NAME LIMIT_S COMMAND... (stdout and stderr to DIR/NAME.log)
  local name=$1 limit=$2 start status
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  status=$?
  record "$name" "$status" $(($(date +%s) - start))
  tail -n 3 "$out/$name.log" >&2
}

if [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  start=$(date +%s)
  site="${GPU_CHECK_SITE:-/tmp/p4bench-site}"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$site" "${GPU_CHECK_WHEELS:-.whl}"/*.whl >"$out/install.log" 2>&1
  status=$?
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  record install "$status" $(($(date +%s) - start))
fi
# this checkout's source roots (pyproject's) come first, installed or not: the check is of this code
export PYTHONPATH="$PWD:$PWD/plugins:$PWD/baselines:$PWD/attacks:$PWD/defenses${PYTHONPATH:+:$PYTHONPATH}"
device="${GPU_CHECK_DEVICE:-cuda}"
"$python" - >"$out/device.json" <<'EOF'
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "available": cuda,
                  "device": torch.cuda.get_device_name(0) if cuda else None,
                  "memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None}))
EOF
cat "$out/device.json" >&2

# 1. the CUDA tests
# only the files that hold CUDA tests: the others may import what the GPU machine lacks (MLflow)
mapfile -t cuda_tests < <(grep -l 'mark\.cuda' tests/*.py)
timed pytest-cuda "${GPU_CHECK_PYTEST_S:-240}" "$python" -m pytest -m cuda -q -p no:cacheprovider -rfEs \
  "${cuda_tests[@]}"

# 2. the benchmark (its last stdout line is the JSON)
timed gpu-bench "${GPU_CHECK_BENCH_S:-300}" "$python" bench/gpu.py --device "$device" ${GPU_CHECK_BENCH_ARGS:-}
grep '^{' "$out/gpu-bench.log" | tail -n 1 >"$out/gpu.json"

# 3. one run per DP method family, on the scatter-CNN
runs="$out/runs.jsonl"
: >"$runs"
results=$(mktemp -d)
families=(
  "p4"                                      # P4: DP proxy (replace-one), groups, p4-secure
  "fedavg --epsilon 8"                      # DP-FedAvg: local DP-SGD, server aggregation
  "proxyfl"                                 # ProxyFL: DP proxy, distillation, directed exchange
  "dp-dsgt --epsilon 8"                     # gossip with DP-SGD gradients (DP-DSGD, DP-DSGT)
  "muffliato --epsilon 8"                   # local DP then gossip averaging
  "pdsl --epsilon 8"                        # noisy cross-gradients and Shapley weights (PDSL, DP-CGA)
  "centralized --epsilon 8"                 # central noise at a trusted server
)
keep=" ${GPU_CHECK_FAMILIES:-${families[*]%% *}} "  # methods to run (default: every family)
for family in "${families[@]}"; do
  read -r method rest <<<"$family"
  [[ "$keep" == *" $method "* ]] || continue
  start=$(date +%s)
  # shellcheck disable=SC2086  # the family's own options
  timeout --kill-after=10 "${GPU_CHECK_RUN_S:-90}" "$python" -c 'from p4bench.cli import main; main()' run --method $method $rest --model scatter-cnn \
    --device "$device" --clients 8 --rounds 2 --json --results-dir "$results" >"$out/run.out" 2>"$out/run.err"
  status=$?
  if [ "$status" -eq 0 ]; then
    tail -n 1 "$out/run.out" >>"$runs"
  else
    "$python" -c 'import json,sys; print(json.dumps({"method": sys.argv[1], "error": open(sys.argv[2]).read()[-1500:]}))' \
      "$method" "$out/run.err" >>"$runs"
  fi
  record "run-$method" "$status" $(($(date +%s) - start))
done
rm -rf "$results" "$out/run.out" "$out/run.err"

# 4. how close the GPU is to the CPU (same seed, same Philox noise)
timed agreement "${GPU_CHECK_AGREEMENT_S:-120}" "$python" bench/gpu_agreement.py --device "$device" ${GPU_CHECK_AGREEMENT_ARGS:-}
grep '^{' "$out/agreement.log" | tail -n 1 >"$out/agreement.json"

# 5. where a round's time goes (for tuning; off by default)
if [ "${GPU_CHECK_PROFILE:-0}" = 1 ]; then
  timed profile "${GPU_CHECK_PROFILE_S:-150}" "$python" bench/gpu_profile.py --device "$device" --out "$out/profile" \
    ${GPU_CHECK_PROFILE_ARGS:-}
fi

# the lent machine returns at most 8 files: with GPU_CHECK_BUNDLE=1 the logs and tables go into one archive
if [ "${GPU_CHECK_BUNDLE:-0}" = 1 ]; then
  (cd "$out" && tar czf logs.tar.gz --remove-files ./*.log $( [ -d profile ] && echo profile ))
fi
printf '{"failed_steps": %d, "steps": [%s]}\n' "$failed" "$(IFS=,; echo "${steps[*]}")" | tee "$out/check.json"
exit "$failed"
