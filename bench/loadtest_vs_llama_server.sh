#!/usr/bin/env bash
# Serving throughput: kvlab serve against llama.cpp's llama-server on the same GGUF and threads,
# both measured by `kvlab loadtest` in one run (one server at a time, the other idle).
#
#   LLAMA_SERVER=/path/to/llama-server bench/loadtest_vs_llama_server.sh [SWEEP] [REQUESTS] [TOKENS]
#
# llama-server comes from a llama.cpp build (for example the llama.cpp sources vendored in the
# llama-cpp-python sdist: cmake -B build && cmake --build build --target llama-server).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
SWEEP=${1:-1,4,8,16}
REQUESTS=${2:-32}
TOKENS=${3:-64}
KVLAB=.venv/bin/kvlab
MODEL=$(.venv/bin/python -c "from kvlab.weights.default_model import default_model_path; print(default_model_path())")
OUT=${OUT:-artifacts}
mkdir -p "$OUT"

source bench/start_servers.sh
start_servers 16

for name in llama-server:8091 kvlab:8092; do
    label=${name%%:*}
    port=${name##*:}
    echo "== $label =="
    "$KVLAB" loadtest --url "http://127.0.0.1:$port" --sweep "$SWEEP" \
        --num-requests "$REQUESTS" --max-tokens "$TOKENS" --ignore-eos --warmup 2 \
        --plot "$OUT/loadtest-$label.png" | tee "$OUT/loadtest-$label.txt"
done
