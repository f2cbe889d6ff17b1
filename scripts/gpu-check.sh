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
# It needs a CUDA GPU and p4bench importable by `python3` (GPU_CHECK_PYTHON picks another
# interpreter). Where the project's dependencies cannot be installed from a registry (the lent
# GPU machine has none), put their wheels in .whl/ and set GPU_CHECK_INSTALL=1: they are
# installed with --no-index first, then p4bench itself (editable, no build isolation).
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
  {
    "$python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check .whl/*.whl &&
      "$python" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e .
  } >"$out/install.log" 2>&1
  record install $? $(($(date +%s) - start))
fi
"$python" - >"$out/device.json" <<'EOF'
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "available": cuda,
                  "device": torch.cuda.get_device_name(0) if cuda else None,
                  "memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None}))
EOF
cat "$out/device.json" >&2

# 1. the CUDA tests
timed pytest-cuda "${GPU_CHECK_PYTEST_S:-240}" "$python" -m pytest -m cuda -q -p no:cacheprovider -rfEs tests

# 2. the benchmark (its last stdout line is the JSON)
timed gpu-bench "${GPU_CHECK_BENCH_S:-300}" "$python" bench/gpu.py --device cuda ${GPU_CHECK_BENCH_ARGS:-}
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
for family in "${families[@]}"; do
  read -r method rest <<<"$family"
  start=$(date +%s)
  # shellcheck disable=SC2086  # the family's own options
  timeout --kill-after=10 "${GPU_CHECK_RUN_S:-90}" "$python" -c 'from p4bench.cli import main; main()' run --method $method $rest --model scatter-cnn \
    --device cuda --clients 8 --rounds 2 --json --results-dir "$results" >"$out/run.out" 2>"$out/run.err"
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
timed agreement "${GPU_CHECK_AGREEMENT_S:-120}" "$python" bench/gpu_agreement.py --device cuda ${GPU_CHECK_AGREEMENT_ARGS:-}
grep '^{' "$out/agreement.log" | tail -n 1 >"$out/agreement.json"

# 5. where a round's time goes (for tuning; off by default)
if [ "${GPU_CHECK_PROFILE:-0}" = 1 ]; then
  timed profile "${GPU_CHECK_PROFILE_S:-150}" "$python" bench/gpu_profile.py --device cuda --out "$out/profile" \
    ${GPU_CHECK_PROFILE_ARGS:-}
fi

# the lent machine returns at most 8 files: with GPU_CHECK_BUNDLE=1 the logs and tables go into one archive
if [ "${GPU_CHECK_BUNDLE:-0}" = 1 ]; then
  (cd "$out" && tar czf logs.tar.gz --remove-files ./*.log $( [ -d profile ] && echo profile ))
fi
printf '{"failed_steps": %d, "steps": [%s]}\n' "$failed" "$(IFS=,; echo "${steps[*]}")" | tee "$out/check.json"
exit "$failed"
