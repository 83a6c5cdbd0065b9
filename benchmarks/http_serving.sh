#!/usr/bin/env bash
# The same seeded request stream served in process (`bench --stream`) and over HTTP (`serve` + `bench --url`) on
# one checkpoint, in two alternating rounds: what HTTP adds (benchmarks/results/http_serving_cpu.md). One torch
# thread on both sides: on a shared 2-core box two OpenMP threads stall each other when the cores are taken.
# DEVICE=cuda serves on the GPU. Records go to runs/bench/http_serving_$DEVICE.jsonl unless REC says where (as every
# benchmark: only REC=benchmarks/results/http_serving_$DEVICE.jsonl adds to the recorded results).
set -euo pipefail
DEVICE=${DEVICE:-cpu}
RUN=${RUN:-runs/http-bench}
REC=${REC:-runs/bench/http_serving_$DEVICE.jsonl}
mkdir -p "$(dirname "$REC")"
PORT=${PORT:-8012}
ENGINE=(--slots 8 --sync-every 8 --threads 1 --device "$DEVICE")
STREAM=(--requests 64 --rate 4 --prompt-range 16,64 --tokens-range 16,64 --seed 0)
[ -f "$RUN/checkpoints/latest" ] || .venv/bin/blockloop train --preset demo --steps 20 --out "$RUN" --no-progress
.venv/bin/blockloop serve --checkpoint "$RUN" --port "$PORT" "${ENGINE[@]}" --log-level warning &
SERVER=$!
trap 'kill $SERVER' EXIT
# Wait for /health with the Python that serves (the GPU machine's image may have no curl).
.venv/bin/python - "$PORT" <<'POLL'
import sys, time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("benchmarks/http_serving.sh: the server did not answer /health within 2 minutes")
POLL
for round in 1 2; do
  echo "round $round: in process"
  .venv/bin/blockloop bench --stream --checkpoint "$RUN" "${ENGINE[@]}" "${STREAM[@]}" --record "$REC"
  echo "round $round: over HTTP"
  .venv/bin/blockloop bench --url "http://127.0.0.1:$PORT" "${STREAM[@]}" --record "$REC"
done
