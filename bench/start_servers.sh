# Sourced by the bench scripts that compare servers: `start_servers N` starts llama-server on
# 127.0.0.1:8091 and kvlab serve on :8092 (both 2 threads; kvlab with --max-num-seqs N) on
# $MODEL, logs into $OUT, stops both when the script exits and waits until both are healthy.
# The default GGUF carries no chat template: llama-server would fall back to ChatML (about 14
# more prompt tokens a request); its built-in "gemma" template renders what kvlab renders.
start_servers() {
    "$LLAMA_SERVER" -m "$MODEL" -t 2 --parallel 8 -c 16384 --host 127.0.0.1 --port 8091 \
        --no-jinja --chat-template gemma >"$OUT/llama-server.log" 2>&1 &
    LLAMA_PID=$!
    "$KVLAB" serve --host 127.0.0.1 --port 8092 --threads 2 --max-num-seqs "$1" \
        >"$OUT/kvlab-serve.log" 2>&1 &
    KVLAB_PID=$!
    trap 'kill $LLAMA_PID $KVLAB_PID 2>/dev/null || true' EXIT
    for port in 8091 8092; do
        for _ in $(seq 120); do
            curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
            sleep 1
        done
    done
}
