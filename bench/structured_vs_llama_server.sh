#!/usr/bin/env bash
# Structured outputs served: kvlab serve against llama.cpp's llama-server on the same GGUF and
# threads, each measured by `kvlab loadtest` with and without a JSON schema (one server at a
# time, the other idle).
#
#   LLAMA_SERVER=/path/to/llama-server bench/structured_vs_llama_server.sh [SWEEP] [REQUESTS]
#
# Constrained runs send bench/schemas/order.json as response_format and stop where the reply
# is complete (no --ignore-eos); unconstrained runs ask for the same max tokens with
# --ignore-eos, so both give output tok/s. The table at the end holds the two ratios:
# kvlab constrained / kvlab unconstrained (the cost of the constraint, target >= 0.95x) and
# kvlab constrained / llama-server constrained (target >= 1.5x).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
SWEEP=${1:-1,8}
REQUESTS=${2:-16}
TOKENS=128
SCHEMA=bench/schemas/order.json
KVLAB=.venv/bin/kvlab
MODEL=$(.venv/bin/python -c "from kvlab.weights.default_model import default_model_path; print(default_model_path())")
OUT=${OUT:-artifacts}
mkdir -p "$OUT"

PROMPTS="$OUT/order_prompts.jsonl"
.venv/bin/python - "$PROMPTS" <<'EOF'
import json
import sys

orders = [("Maria Lopez", "12 Harbour Street", "two boxes of green tea and a teapot"),
          ("Kenji Sato", "4-2 Sakura Lane", "one rice cooker"),
          ("Amara Okafor", "88 Baobab Avenue", "three notebooks, a pen and a stapler"),
          ("Lukas Becker", "7 Lindenweg", "a bicycle pump and two inner tubes"),
          ("Priya Nair", "221 Lotus Road", "five jars of honey"),
          ("Tom Walsh", "3 Cliff Cottages", "a raincoat and wellington boots"),
          ("Sofia Rossi", "19 Via Roma", "two espresso cups and coffee beans"),
          ("Omar Haddad", "56 Cedar Court", "one desk lamp")]
with open(sys.argv[1], "w") as f:
    for name, street, items in orders:
        text = (f"Write the order record as JSON: {name}, ships to {street}, wants {items}. "
                "Give the customer's full name, an account number, the address, a delivery "
                "priority and the items with quantities.")
        f.write(json.dumps({"prompt": text}) + "\n")
EOF

source bench/start_servers.sh
start_servers 8

for name in llama-server:8091 kvlab:8092; do
    label=${name%%:*}
    port=${name##*:}
    for mode in constrained unconstrained; do
        echo "== $label, $mode ==" >&2
        if [ "$mode" = constrained ]; then shape=(--json-schema "$SCHEMA"); else shape=(--ignore-eos); fi
        "$KVLAB" loadtest --url "http://127.0.0.1:$port" --sweep "$SWEEP" \
            --num-requests "$REQUESTS" --max-tokens "$TOKENS" --warmup 2 \
            --prompts "$PROMPTS" "${shape[@]}" --json >"$OUT/structured-$label-$mode.json"
    done
done

.venv/bin/python - "$OUT" <<'EOF'
import json
import sys

out = sys.argv[1]
runs = {}
for server in ("llama-server", "kvlab"):
    for mode in ("constrained", "unconstrained"):
        with open(f"{out}/structured-{server}-{mode}.json") as f:
            for s in json.load(f)["sweep"]:
                runs[server, mode, s["concurrency"]] = s

print(f"{'server':<13}{'mode':<14}{'conc':>5}{'out tok/s':>10}{'TTFT p50':>9}{'TTFT p99':>9}"
      f"{'tok/reply':>10}{'forced':>8}{'valid':>8}{'failed':>7}")
for (server, mode, conc), s in runs.items():
    forced = "-" if s["forced_share"] is None else f"{100 * s['forced_share']:.1f}%"
    valid = "-" if s["valid"] is None else f"{s['valid']}/{s['completed']}"
    per_reply = s["total_output_tokens"] / max(s["completed"], 1)
    print(f"{server:<13}{mode:<14}{conc:>5}{s['output_throughput']:>10.1f}"
          f"{s['ttft_ms']['p50']:>9.1f}{s['ttft_ms']['p99']:>9.1f}{per_reply:>10.1f}"
          f"{forced:>8}{valid:>8}{s['failed']:>7}")
print("(TTFT in ms; valid: replies that parse and follow the schema; forced: share of output "
      "tokens the server reports as forced)")


def ratio(a, b, target):
    x = a["output_throughput"] / b["output_throughput"] if b["output_throughput"] else 0.0
    return f"{x:.2f}x ({'meets' if x >= target else 'below'} {target}x)"


print(f"\n{'conc':>5}  {'kvlab constrained / unconstrained':<36}"
      "kvlab / llama-server, constrained")
for conc in sorted({c for _, _, c in runs}):
    kv = runs["kvlab", "constrained", conc]
    print(f"{conc:>5}  {ratio(kv, runs['kvlab', 'unconstrained', conc], 0.95):<36}"
          f"{ratio(kv, runs['llama-server', 'constrained', conc], 1.5)}")
print("(ratios of output tok/s)")
EOF
