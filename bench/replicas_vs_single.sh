#!/usr/bin/env bash
# Serving throughput of replicas: `kvlab loadtest -c C` against one `kvlab serve --threads T`,
# then against `kvlab serve --replicas R --threads T` (Ray Serve), one server at a time, in
# ROUNDS alternating rounds so that load from elsewhere on the machine shows as spread.
#
#   bench/replicas_vs_single.sh [REPLICAS] [THREADS] [CONCURRENCY] [ROUNDS]
#
# Prints each run's figures, where its CPU went (bench/proc_cpu.py: core-s per 1,000 output
# tokens of each engine replica, the ingress, Serve's proxy, Ray's daemons, the client and
# other load on the machine) and the output tok/s of every run; logs go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
REPLICAS=${1:-2}
THREADS=${2:-1}
CONCURRENCY=${3:-8}
ROUNDS=${4:-2}
KVLAB=${KVLAB:-.venv/bin/kvlab}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-artifacts}
PORT=8093
mkdir -p "$OUT"

healthy() {  # /health answers 200 with this many healthy replicas (0: a single server)
    local body
    body=$(curl -sf "http://127.0.0.1:$PORT/health") || return 1
    [ "$1" = 0 ] || grep -q "\"healthy\":$1" <<<"$body"
}

measure() {  # label replicas(0: single) serve-flags...
    local label=$1 want=$2
    shift 2
    "$KVLAB" serve --port "$PORT" --log-level warning "$@" >"$OUT/serve-$label.log" 2>&1 &
    local pid=$!
    for _ in $(seq 300); do healthy "$want" && break; sleep 1; done
    echo "== $label: kvlab serve $* (load $(cut -d' ' -f1-3 /proc/loadavg)) =="
    "$PYTHON" bench/proc_cpu.py $((CONCURRENCY * 6 * 64)) -- \
        "$KVLAB" loadtest --url "http://127.0.0.1:$PORT" -c "$CONCURRENCY" -n $((CONCURRENCY * 6)) \
        --max-tokens 64 --ignore-eos --endpoint completions | tee "$OUT/loadtest-$label.txt"
    kill -INT "$pid"
    wait "$pid" || true
}

for round in $(seq "$ROUNDS"); do
    measure "single-$round" 0 --threads "$THREADS"
    measure "replicas-$round" "$REPLICAS" --replicas "$REPLICAS" --threads "$THREADS"
done
grep -H -e "output tok/s" -e "core-s per" "$OUT"/loadtest-single-*.txt \
    "$OUT"/loadtest-replicas-*.txt
