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
MODEL=$(.venv/bin/python -c "from kvlab.weights import default_model_path; print(default_model_path())")
OUT=${OUT:-artifacts}
mkdir -p "$OUT"

# The default GGUF carries no chat template: llama-server would fall back to ChatML (about 14
# more prompt tokens a request); its built-in "gemma" template renders what kvlab renders.
"$LLAMA_SERVER" -m "$MODEL" -t 2 --parallel 8 -c 16384 --host 127.0.0.1 --port 8091 \
    --no-jinja --chat-template gemma >"$OUT/llama-server.log" 2>&1 &
LLAMA_PID=$!
"$KVLAB" serve --host 127.0.0.1 --port 8092 --threads 2 --max-num-seqs 16 \
    >"$OUT/kvlab-serve.log" 2>&1 &
KVLAB_PID=$!
trap 'kill $LLAMA_PID $KVLAB_PID 2>/dev/null || true' EXIT

for port in 8091 8092; do
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 1
    done
done

for name in llama-server:8091 kvlab:8092; do
    label=${name%%:*}
    port=${name##*:}
    echo "== $label =="
    "$KVLAB" loadtest --url "http://127.0.0.1:$port" --sweep "$SWEEP" \
        --num-requests "$REQUESTS" --max-tokens "$TOKENS" --ignore-eos --warmup 2 \
        --plot "$OUT/loadtest-$label.png" | tee "$OUT/loadtest-$label.txt"
done
