#!/usr/bin/env bash
# The GPU measurements the open issues still owe, most wanted first, in one device call: a lent machine gives a
# session 15 minutes of device time and a call 10 minutes at most, so a GPU session should spend one call on this,
# not several hand-written ones. Each step runs through env.sh with its own time cap, cut to what is left of the
# call's budget (SECONDS_BUDGET, default 560 s: the device tool's 600 s limit less a margin), and is not started with
# less than its minimum left (the time below which it would measure nothing); a step stopped at its cap keeps what it
# wrote (the suite writes each measurement as it is taken, the other scripts after every row). Each step's output goes to
# $OUT/owed-<step>.log and its results under $OUT (packed into $OUT/owed.tgz when more than the 8 files a call brings
# back); the last lines say how each step ended.
#
#   bash benchmarks/device/owed.sh                            # the default steps, in this order
#   SECONDS_BUDGET=250 bash benchmarks/device/owed.sh pytest-in-place decode-profile decode-search
#                                                             # a second call while the machine is warm: what the first left
#
# The default is what is still owed after the H200 runs of 2026-11-27/28 (benchmarks/results/gpu-2026-11-28-nvidia-h200.md),
# most wanted first: the Triton kernel's CUDA tests and the paged in-place checks (test files in that order, each test
# named as it ends: a step cut at its cap says how far it got); decode-heavy again (the static step now reads only its
# key length of each row, timed beside the step reading every slot: the 85% roofline target, and the paged cache read
# by blockloop's Triton kernel; HF generate() and the Flex paged read were measured on 11-28 and are skipped: the
# compiles, a graph per key length and engine, take most of the step); the profile's live-length reads (the kernel at
# three key tiles beside Flex); then, in a later call or session, issue 12's recursive and training rows (recursive
# fills a call on its own: it trains, converts and uptrains a model first; training is the 302M MFU row) and the batch
# search (its own file: --tag search). prefill-double, pytest-gpu, staircase and http were measured there and stay as
# steps.
#   DRY_RUN=1 bash benchmarks/device/owed.sh                  # print each step's cap and command, run nothing
#
# Device tool call: carry=[".device-kit"] (packed here by `.venv/bin/python benchmarks/device/kit.py --no-smollm2`),
# timeout_s=600. The `smollm2` step needs the kit's two SmolLM2 halves joined first (see kit.py).
set -uo pipefail
OUT=${OUT:-runs/owed}
BUDGET=${SECONDS_BUDGET:-560}
mkdir -p "$OUT"
ENV=(bash benchmarks/device/env.sh)
PY=(.venv/bin/python)
# The GPU tests in two runs: the engine's compiled-decode ones last (each compiles a model; 7 of 8 passed on the
# H200 on 2026-11-27), so a step stopped at its cap has run the tests no GPU has run yet.
PYTEST="-p no:cacheprovider --durations=20 -o log_level=WARNING"

# The in-place checks' test files, the kernel's first: each has run on no GPU yet.
IN_PLACE="tests/test_paged_decode_kernel.py tests/test_paged_cache.py tests/test_compile_decode.py tests/test_key_limits.py"

# step name -> "minimum|cap|command" in seconds (the command is run by bash -c after env.sh, in the repository root)
declare -A STEPS=(
  [decode-heavy]="200|330|${PY[*]} benchmarks/gpu_suite.py --rows decode-heavy --repeats 1 --decode-batches 256 --max-batch 256 --skip hf,paged --out-dir $OUT"
  [decode-profile]="60|150|${PY[*]} benchmarks/decode_profile.py --out-dir $OUT"
  [pytest-gpu]="120|240|${PY[*]} -m pytest -m gpu -k 'not compiled_cuda_graph_decode' -q $PYTEST; first=\$?; ${PY[*]} -m pytest -m gpu -k compiled_cuda_graph_decode -q $PYTEST && exit \$first"
  [pytest-in-place]="60|150|${PY[*]} -m pytest -m gpu $IN_PLACE -k "'"compiled_kernel or paged_decode_under_cuda_graphs or compiled_cuda_step_writes or key_lengths"'" -v $PYTEST"
  [decode-search]="400|560|${PY[*]} benchmarks/gpu_suite.py --rows decode-heavy --repeats 1 --decode-batches 512 --max-batch 4096 --skip hf,whole-keys,paged,paged-kernel --tag search --out-dir $OUT"
  [prefill-double]="120|220|${PY[*]} benchmarks/gpu_suite.py --rows prefill-heavy,double-decoder --repeats 1 --out-dir $OUT"
  [staircase]="30|90|${PY[*]} benchmarks/staircase_speed.py --device cuda --out-dir $OUT"
  [http]="100|200|DEVICE=cuda REC=$OUT/http_serving_cuda.jsonl bash benchmarks/http_serving.sh"
  [recursive]="400|560|${PY[*]} benchmarks/gpu_suite.py --rows recursive --out-dir $OUT"
  [training]="150|300|${PY[*]} benchmarks/gpu_suite.py --rows training --out-dir $OUT"
  [smollm2]="200|400|.venv/bin/blockloop convert --from-hf smollm2 --out runs/smollm2 --no-progress && ${PY[*]} benchmarks/zero_shot_speed.py --checkpoint runs/smollm2 --device cuda --out-dir $OUT && ${PY[*]} benchmarks/recursive_uptrain.py --source smollm2 --device cuda --out-dir $OUT"
)
DEFAULT=(pytest-in-place decode-heavy decode-profile recursive training decode-search)
ORDER=("$@")
[ ${#ORDER[@]} -gt 0 ] || ORDER=("${DEFAULT[@]}")
for name in "${ORDER[@]}"; do
  if [ -z "${STEPS[$name]+set}" ]; then
    echo "benchmarks/device/owed.sh: no step '$name'; the steps are: ${!STEPS[*]}" >&2
    exit 2
  fi
done

START=$SECONDS
SUMMARY=()
for name in "${ORDER[@]}"; do
  IFS='|' read -r least cap command <<<"${STEPS[$name]}"
  left=$((BUDGET - (SECONDS - START)))
  limit=$((cap < left ? cap : left))
  if [ -n "${DRY_RUN:-}" ]; then
    echo "$name ($least-$cap s): $command"
    continue
  fi
  if [ "$left" -lt "$least" ]; then
    SUMMARY+=("$name: not run, ${left} s of the budget left (it needs $least)")
    continue
  fi
  echo "== $name: at most $limit s"
  began=$SECONDS
  timeout -k 10 "$limit" "${ENV[@]}" bash -c "$command" >"$OUT/owed-$name.log" 2>&1
  status=$?
  tail -n 25 "$OUT/owed-$name.log"
  case $status in
    0) how="done" ;;
    124 | 137) how="stopped at its $limit s cap" ;;
    *) how="failed (exit $status)" ;;
  esac
  SUMMARY+=("$name: $how in $((SECONDS - began)) s")
done
[ -n "${DRY_RUN:-}" ] && exit 0
# A device call brings back at most 8 files from $OUT: past that, all of them travel as one archive.
count=$(find "$OUT" -type f | wc -l)
if [ "$count" -gt 8 ]; then
  tar -czf "$OUT.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$OUT.tgz" "$OUT/owed.tgz"
  SUMMARY+=("results: $count files packed into $OUT/owed.tgz (a device call brings back at most 8)")
fi
echo "== summary (log of each step: $OUT/owed-<step>.log)"
printf '%s\n' "${SUMMARY[@]}"
