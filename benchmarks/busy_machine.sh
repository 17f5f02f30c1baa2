#!/usr/bin/env bash
# Batch-1 decode on a busy machine: tokenloom and llama.cpp's llama-server (the same GGUF, 2 threads each),
# taking turns, with 0, 1 and 3 busy-looping processes beside the server (started from the same session,
# as another tenant's work would be). Reports each server's TPOT p50 and its ratio to the quiet one.
#   bash ../shared/tools/build_llamacpp.sh     # once
#   MODEL=qwen2.5-coder-0.5b bash benchmarks/busy_machine.sh
# Results: benchmarks/results/busy_machine[-MODEL]/summary.json; the per-run files (server logs, each
# cell's output) in RAW, default benchmarks/runs/busy_machine[-MODEL]/, which git ignores.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-}
OUT=benchmarks/results/busy_machine${MODEL:+-$MODEL}
RAW=${RAW:-benchmarks/runs/$(basename "$OUT")}
mkdir -p "$OUT" "$RAW"
LLAMA_BIN=${LLAMA_BIN:-$(dirname "$(mktemp -u)")/llamacpp/build/bin/llama-server}
if [[ -n $MODEL ]]; then
    GGUF=$(.venv/bin/python -c "import sys; from tokenloom.model import catalog; print(catalog.pull(sys.argv[1], progress=False))" "$MODEL")
else
    GGUF=$(.venv/bin/python -c "from tokenloom.model.load import model_path; print(model_path(None))")
fi
PORT=8124
BUSY_COUNTS=${BUSY_COUNTS:-"0 1 3"}

start() {
    case "$1" in
        llama) "$LLAMA_BIN" -m "$GGUF" -t 2 --parallel 4 -c 4096 --port $PORT --alias m >"$RAW/$1.log" 2>&1 & ;;
        tokenloom) .venv/bin/tokenloom serve --model "$GGUF" --served-model-name m --port $PORT >"$RAW/$1.log" 2>&1 & ;;
    esac
    PID=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
        sleep 0.5
    done
    echo "$1 did not start" >&2; return 1
}

for server in llama tokenloom; do
    echo "== $server"
    start "$server"
    .venv/bin/tokenloom bench serve --base-url "http://127.0.0.1:$PORT" --no-progress --no-align-prompts --dataset random \
        --input-len 64 --output-len 8 --num-prompts 2 --seed 0 --out "$RAW/$server-warmup.json" >/dev/null
    for busy in $BUSY_COUNTS; do
        pids=()
        for _ in $(seq "$busy"); do (while :; do :; done) & pids+=($!); done
        .venv/bin/tokenloom bench serve --base-url "http://127.0.0.1:$PORT" --no-progress --no-align-prompts \
            --dataset random --input-len 64 --output-len 64 --num-prompts 4 --max-concurrency 1 --seed 1 \
            --out "$RAW/$server-busy$busy.json" | grep -i "tpot" | head -3
        if ((${#pids[@]})); then  # (a bare `wait` would wait for the server too)
            kill "${pids[@]}"
            wait "${pids[@]}" 2>/dev/null || true
        fi
    done
    kill "$PID"; wait "$PID" 2>/dev/null || true
    sleep 2
done

BUSY_COUNTS=$BUSY_COUNTS MODEL=$MODEL .venv/bin/python - "$OUT" "$RAW" <<'PY'
import json, os, sys
out, raw = sys.argv[1], sys.argv[2]
counts = os.environ["BUSY_COUNTS"].split()
rows = {}
for server in ("llama", "tokenloom"):
    tpot = {b: json.load(open(f"{raw}/{server}-busy{b}.json"))["median_tpot_ms"] for b in counts}
    rows[server] = {"tpot_p50_ms": tpot, "ratio_to_quiet": {b: tpot[b] / tpot[counts[0]] for b in counts}}
model = os.environ.get("MODEL") or "smollm2-135m"
summary = {"command": (f"MODEL={model} " if os.environ.get("MODEL") else "") + "bash benchmarks/busy_machine.sh",
           "model": model, "busy_processes": counts, "servers": rows}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(rows, indent=2))
PY
