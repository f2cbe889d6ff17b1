#!/usr/bin/env bash
# The whole GPU check in one bounded go, every result as JSON in one folder, most important first:
#   1. bench/gpu.py (P4 linear and scatter-CNN at 260 and 2,080 clients, DP-FedAvg linear at 100,000)
#                                          -> DIR/gpu.json
#   2. pytest -m cuda (the files that hold CUDA tests)
#   3. bench/gpu_agreement.py: CPU and CUDA runs of one seed, Philox noise on both -> DIR/agreement.json
#   4. one `p4bench run ... --model scatter-cnn --device cuda --json` per DP method family
#                                          -> DIR/runs.jsonl (one summary per line, or the error)
#   5. bench/gpu_profile.py: where a P4 round's time goes (kernels, host syncs, memory peak)
#                                          -> profile/ in DIR/logs.tar.gz (GPU_CHECK_PROFILE=0: skipped)
#   DIR/check.json: every step's exit status and seconds, rewritten after each step.
#   DIR/logs.tar.gz: every step's log (and the profile's tables), rewritten after each step.
# A lent GPU machine returns at most 8 files from DIR: these are 6 (with device.json), and a run
# cut off at the call's limit still leaves the steps done so far.
# Usage: scripts/gpu-check.sh [DIR]   (default: gpu-check-results; $OUT on the lent GPU machine)
#
# It needs a CUDA GPU and `python3` with torch (GPU_CHECK_PYTHON picks another interpreter).
# The lent GPU machine has no registry: `scripts/gpu-wheels.sh` downloads the missing
# dependencies into .whl/ here; carry .whl and set GPU_CHECK_INSTALL=1 there, and they are
# unpacked (from GPU_CHECK_WHEELS, default .whl) into GPU_CHECK_SITE (default
# /tmp/p4bench-site), nothing written into the image's environment. p4bench itself runs from
# this checkout's source roots (put on PYTHONPATH; no build step).
#
# Time: the whole check ends within GPU_CHECK_BUDGET_S seconds (default 540, inside the device
# tool's 600 s call). Each step runs under the smaller of its own limit (GPU_CHECK_BENCH_S,
# _PYTEST_S, _AGREEMENT_S, _RUN_S per family, _PROFILE_S) and what is left of the budget; a step
# with under 20 s left is recorded as skipped. A failing step is recorded and the next one runs.
# GPU_CHECK_DEVICE=cpu rehearses the whole script on a machine without a GPU (with
# GPU_CHECK_BENCH_ARGS=--quick): the CUDA tests skip, every other step runs.
# GPU_CHECK_FAMILIES="p4 fedavg" runs only those methods' families in step 4.
# GPU_CHECK_BENCH_ARGS="--private-precision fp32 tf32" also times P4's scatter-CNN with its
# private model in TF32 (about a minute more at 2,080 clients).
# The exit status is the number of failed steps (0: all passed; a skipped step is not a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-results}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
logs="$(mktemp -d)"  # bundled into DIR/logs.tar.gz: DIR itself holds few files
trap 'rm -rf "$logs"' EXIT
python="${GPU_CHECK_PYTHON:-python3}"
device="${GPU_CHECK_DEVICE:-cuda}"
deadline=$(($(date +%s) + ${GPU_CHECK_BUDGET_S:-540}))
export PYTHONUNBUFFERED=1 P4BENCH_DISABLE_PLUGIN_AUTOLOAD=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
failed=0
steps=()

write_check() {
  printf '{"failed_steps": %d, "budget_s": %d, "steps": [%s]}\n' "$failed" \
    "${GPU_CHECK_BUDGET_S:-540}" "$(IFS=,; echo "${steps[*]}")" >"$out/check.json"
  tar czf "$out/logs.tar.gz" -C "$logs" .
}

record() {  # record NAME STATUS SECONDS (STATUS "skipped": no time was left for it)
  if [ "$2" = skipped ]; then
    steps+=("{\"step\": \"$1\", \"status\": \"skipped\", \"seconds\": 0}")
  else
    steps+=("{\"step\": \"$1\", \"status\": $2, \"seconds\": $3}")
    [ "$2" -eq 0 ] || failed=$((failed + 1))
  fi
  echo "== $1: exit $2 in $3 s" >&2
  write_check
}

limit() {  # limit STEP_LIMIT_S: the step's limit within what is left of the budget (0: skip)
  local left=$((deadline - $(date +%s) - 10))
  [ "$left" -ge 20 ] || { echo 0; return; }
  echo $(("$1" < left ? "$1" : left))
}

timed() {  # timed NAME LIMIT_S COMMAND... (stdout and stderr to the NAME.log in the bundle)
  local name=$1 budget start status
  budget=$(limit "$2")
  shift 2
  [ "$budget" -gt 0 ] || { record "$name" skipped 0; return; }
  start=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" >"$logs/$name.log" 2>&1
  status=$?
  record "$name" "$status" $(($(date +%s) - start))
  tail -n 3 "$logs/$name.log" >&2
}

if [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  start=$(date +%s)
  site="${GPU_CHECK_SITE:-/tmp/p4bench-site}"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$site" "${GPU_CHECK_WHEELS:-.whl}"/*.whl >"$logs/install.log" 2>&1
  status=$?
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  record install "$status" $(($(date +%s) - start))
fi
# this checkout's source roots (pyproject's) come first, installed or not: the check is of this code
export PYTHONPATH="$PWD:$PWD/plugins:$PWD/baselines:$PWD/attacks:$PWD/defenses${PYTHONPATH:+:$PYTHONPATH}"
"$python" - >"$out/device.json" <<'EOF'
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "available": cuda,
                  "device": torch.cuda.get_device_name(0) if cuda else None,
                  "memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None}))
EOF
cat "$out/device.json" >&2

# 1. the benchmark: the issue's timings (its last stdout line is the JSON)
# shellcheck disable=SC2086  # the arguments' own words
timed gpu-bench "${GPU_CHECK_BENCH_S:-300}" "$python" bench/gpu.py --device "$device" ${GPU_CHECK_BENCH_ARGS:-}
grep '^{' "$logs/gpu-bench.log" 2>/dev/null | tail -n 1 >"$out/gpu.json"

# 2. the CUDA tests, only the files that hold them: the others import MLflow, which the GPU
# machine may lack
mapfile -t cuda_tests < <(grep -l 'mark\.cuda' tests/*.py)
timed pytest-cuda "${GPU_CHECK_PYTEST_S:-240}" "$python" -m pytest -m cuda -q -p no:cacheprovider -rfEs \
  "${cuda_tests[@]}"

# 3. how close the GPU is to the CPU (same seed, same Philox noise)
# shellcheck disable=SC2086
timed agreement "${GPU_CHECK_AGREEMENT_S:-120}" "$python" bench/gpu_agreement.py --device "$device" \
  ${GPU_CHECK_AGREEMENT_ARGS:-}
grep '^{' "$logs/agreement.log" 2>/dev/null | tail -n 1 >"$out/agreement.json"

# 4. one run per DP method family, on the scatter-CNN
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
  budget=$(limit "${GPU_CHECK_RUN_S:-90}")
  [ "$budget" -gt 0 ] || { record "run-$method" skipped 0; continue; }
  start=$(date +%s)
  # shellcheck disable=SC2086  # the family's own options
  timeout --kill-after=10 "$budget" "$python" -c 'from p4bench.cli import main; main()' run --method $method $rest \
    --model scatter-cnn --device "$device" --clients 8 --rounds 2 --json --results-dir "$results" \
    >"$logs/run-$method.out" 2>"$logs/run-$method.log"
  status=$?
  if [ "$status" -eq 0 ]; then
    tail -n 1 "$logs/run-$method.out" >>"$runs"
  else
    "$python" -c 'import json,sys; print(json.dumps({"method": sys.argv[1], "error": open(sys.argv[2]).read()[-1500:]}))' \
      "$method" "$logs/run-$method.log" >>"$runs"
  fi
  rm -f "$logs/run-$method.out"
  record "run-$method" "$status" $(($(date +%s) - start))
done
rm -rf "$results"

# 5. where a round's time goes: kernels, host syncs, memory peak (tables in the bundle's profile/)
if [ "${GPU_CHECK_PROFILE:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  timed profile "${GPU_CHECK_PROFILE_S:-150}" "$python" bench/gpu_profile.py --device "$device" \
    --out "$logs/profile" ${GPU_CHECK_PROFILE_ARGS:-}
fi

write_check
cat "$out/check.json"
exit "$failed"
