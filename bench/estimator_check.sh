#!/usr/bin/env bash
# The estimator against this machine: PAIRS rounds of `kvlab probe` then `kvlab bench -p 512
# -n 128 -r 3 -d 0,1024,4096 --estimate`, then `kvlab loadtest --sweep 1,4,8,16 --estimate`
# against `kvlab serve`, all at THREADS threads, the load average printed before each.
#
#   bench/estimator_check.sh [PAIRS] [THREADS]
#
# The probe cache goes to $KVLAB_CACHE_DIR (default: a folder under $OUT, so the user's own
# cache is left alone); logs and each command's output go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=${1:-3}
THREADS=${2:-2}
KVLAB=${KVLAB:-.venv/bin/kvlab}
OUT=${OUT:-artifacts/estimator}
PORT=${PORT:-8731}
mkdir -p "$OUT"
export KVLAB_CACHE_DIR=${KVLAB_CACHE_DIR:-$OUT/cache}

load() { echo "(load $(cut -d' ' -f1-3 /proc/loadavg))"; }

for pair in $(seq "$PAIRS"); do
    echo "== pair $pair: kvlab probe --threads $THREADS $(load) =="
    "$KVLAB" probe --threads "$THREADS" | tee "$OUT/probe-$pair.txt"
    echo "== pair $pair: kvlab bench --estimate $(load) =="
    "$KVLAB" bench -p 512 -n 128 -r 3 -d 0,1024,4096 -t "$THREADS" --estimate \
        | tee "$OUT/bench-$pair.txt"
done

"$KVLAB" serve --port "$PORT" --threads "$THREADS" --log-level warning >"$OUT/serve.log" 2>&1 &
pid=$!
trap 'kill -INT "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
echo "== kvlab loadtest --sweep 1,4,8,16 --estimate $(load) =="
"$KVLAB" loadtest --url "http://127.0.0.1:$PORT" --sweep 1,4,8,16 --estimate \
    | tee "$OUT/loadtest.txt"
echo "== done $(load) =="
