#!/usr/bin/env bash
# tokenloom against llama.cpp's llama-server (and vLLM-CPU when PEERS includes vllm) on the same
# cores and the same client, servers taking turns (never two up at once), two cells each:
#   c1:    8 requests one at a time, ~128-token prompts, 128 tokens out (TPOT / TTFT at batch 1)
#   mixed: 64 requests, 32 concurrent, outputs alternating 16 / 256 (throughput under load)
# Results: the summary in benchmarks/results/peers/summary.json (OUT); the per-run files (server logs, each
# cell's output) in RAW, default benchmarks/runs/<OUT's name>/, which git ignores.
#   bash ../shared/tools/build_llamacpp.sh          # once (~10 min)
#   bash ../shared/tools/vllm_cpu_peer.sh setup     # once, only for PEERS="... vllm"
#   PEERS="llama tokenloom-int4 vllm" bash benchmarks/peers.sh
# another model, every server on the same GGUF (vLLM on its conversion: vllm_cpu_peer.sh convert FILE NAME):
#   MODEL=qwen2.5-coder-0.5b PEERS="llama tokenloom-int4 vllm" bash benchmarks/peers.sh
# ISA=avx2 plays an AVX2-only machine on an AVX-512 one: tokenloom with torch, oneDNN and its own kernels
# held to AVX2, against a llama-server built without AVX-512 (LLAMA_BIN; results in peers-avx2/):
#   cmake -B build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
#     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
#     -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build-avx2 --target llama-server -j2
#   (in the llama.cpp tree build_llamacpp.sh unpacked), then
#   ISA=avx2 LLAMA_BIN=.../build-avx2/bin/llama-server PEERS="llama tokenloom-int4" bash benchmarks/peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# OUT: peers/ on an AVX-512 machine, peers-avx2/ when played (ISA=avx2), peers-avx2-native/ on an AVX2-only CPU.
ISA=${ISA:-native}
if [[ $ISA == avx2 ]]; then
    OUT=${OUT:-benchmarks/results/peers-avx2}
elif grep -qw avx512f /proc/cpuinfo; then
    OUT=${OUT:-benchmarks/results/peers}
else
    OUT=${OUT:-benchmarks/results/peers-avx2-native}
fi
# MODEL: a catalog name (tokenloom pull NAME) served by every peer from the same GGUF file; results in
# <OUT>-<MODEL>/. Unset: the bundled SmolLM2. MODEL_FILE: a GGUF path served under the name MODEL instead.
MODEL=${MODEL:-}
[[ -n $MODEL ]] && OUT=$OUT-$MODEL
RAW=${RAW:-benchmarks/runs/$(basename "$OUT")}
mkdir -p "$OUT" "$RAW"
PEERS=${PEERS:-"llama tokenloom-fp32 tokenloom-int4"}
LLAMA_BIN=${LLAMA_BIN:-$(dirname "$(mktemp -u)")/llamacpp/build/bin/llama-server}
TOKENLOOM_ENV=()
if [[ $ISA == avx2 ]]; then
    TOKENLOOM_ENV=(TOKENLOOM_MAX_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)
fi
if [[ -n ${MODEL_FILE:-} ]]; then  # a GGUF file of one's own (benchmarks/shaped_checkpoint.py), named MODEL
    GGUF=$MODEL_FILE
    ALIAS=${MODEL:?MODEL names the file given as MODEL_FILE}
elif [[ -n $MODEL ]]; then
    GGUF=$(.venv/bin/python -c "import sys; from tokenloom.model import catalog; print(catalog.pull(sys.argv[1], progress=False))" "$MODEL")
    ALIAS=$MODEL
else
    GGUF=$(.venv/bin/python -c "from tokenloom.model.load import model_path; print(model_path(None))")
    ALIAS=SmolLM2-135M-Instruct
fi
PORT=8123

start() {
    case "$1" in
        llama) "$LLAMA_BIN" -m "$GGUF" -t 2 --parallel 32 -c 16384 --port $PORT --alias "$ALIAS" >"$RAW/$1.log" 2>&1 & ;;
        tokenloom-fp32) env "${TOKENLOOM_ENV[@]}" .venv/bin/tokenloom serve --model "$GGUF" --served-model-name "$ALIAS" --port $PORT --quantization none >"$RAW/$1.log" 2>&1 & ;;
        tokenloom-int4) env "${TOKENLOOM_ENV[@]}" .venv/bin/tokenloom serve --model "$GGUF" --served-model-name "$ALIAS" --port $PORT --quantization auto >"$RAW/$1.log" 2>&1 & ;;
        vllm) bash ../shared/tools/vllm_cpu_peer.sh serve $PORT bfloat16 ${MODEL:-smollm2} >"$RAW/$1.log" 2>&1 & ;;
        vllm-fp32) bash ../shared/tools/vllm_cpu_peer.sh serve $PORT float32 ${MODEL:-smollm2} >"$RAW/$1.log" 2>&1 & ;;
    esac
    PID=$!
    local t0=$SECONDS
    for _ in $(seq 600); do
        if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; then
            echo $((SECONDS - t0)) >"$RAW/$1-ready-s"
            return 0
        fi
        sleep 0.5
    done
    echo "$1 did not start" >&2; return 1
}

tree_pids() {  # each pid given and every descendant of it
    local pid
    for pid in "$@"; do
        echo "$pid"
        tree_pids $(pgrep -P "$pid" || true)
    done
}

bench() {  # server cell args...
    local name=$1 cell=$2; shift 2
    .venv/bin/tokenloom bench serve --base-url "http://127.0.0.1:$PORT" --no-progress --no-align-prompts \
        --input-len 128 --seed 0 --out "$RAW/$name-$cell.json" "$@" | tail -n 25
}

for server in $PEERS; do
    echo "== $server"
    start "$server"
    bench "$server" warmup --dataset random --num-prompts 2 --output-len 8 >/dev/null
    bench "$server" c1 --dataset random --num-prompts 8 --max-concurrency 1 --output-len 128
    bench "$server" mixed --dataset mixed --num-prompts 64 --max-concurrency 32
    # Peak RSS of the server's whole process tree (vLLM's engine core runs below its API server's children).
    rss=0
    for pid in $(tree_pids "$PID"); do
        kb=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
        rss=$((rss + ${kb:-0}))
    done
    echo "$rss" >"$RAW/$server-peak-rss-kb"
    kill "$PID"; wait "$PID" 2>/dev/null || true
    sleep 2
done

ISA=$ISA MODEL=$MODEL MODEL_FILE=${MODEL_FILE:-} .venv/bin/python - "$OUT" "$RAW" $PEERS <<'PY'
import json, os, sys, platform
out, raw, servers = sys.argv[1], sys.argv[2], sys.argv[3:]
flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()[2:]
                if f.startswith(("avx", "amx", "fma"))})
rows = {}
for s in servers:
    c1, mixed = (json.load(open(f"{raw}/{s}-{cell}.json")) for cell in ("c1", "mixed"))
    rows[s] = {"c1_output_tok_s": c1["output_throughput"], "c1_tpot_p50_ms": c1["median_tpot_ms"],
               "c1_ttft_p50_ms": c1["median_ttft_ms"], "mixed_output_tok_s": mixed["output_throughput"],
               "peak_rss_mb": int(open(f"{raw}/{s}-peak-rss-kb").read()) / 1024,
               "ready_s": int(open(f"{raw}/{s}-ready-s").read())}
for peer in ("llama", "vllm", "vllm-fp32"):
    base = rows.get(peer)
    if base:
        for s, r in rows.items():
            r[f"vs_{peer}"] = {"c1_tpot_ratio": r["c1_tpot_p50_ms"] / base["c1_tpot_p50_ms"],
                               "c1_ttft_ratio": r["c1_ttft_p50_ms"] / base["c1_ttft_p50_ms"],
                               "mixed_throughput_ratio": r["mixed_output_tok_s"] / base["mixed_output_tok_s"]}
isa = os.environ.get("ISA", "native")
model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
model_env = os.environ.get("MODEL", "")
model_file = os.environ.get("MODEL_FILE", "")
summary = {"command": ("ISA=avx2 " if isa == "avx2" else "") + (f"MODEL_FILE={model_file} " if model_file else "")
           + (f"MODEL={model_env} " if model_env else "")
           + "PEERS='" + " ".join(servers) + "' bash benchmarks/peers.sh", "model": model_env or "smollm2-135m",
           "isa": isa, "cpu_model": model, "cpu_flags": flags,
           "machine": platform.machine(), "servers": rows}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(rows, indent=2))
PY
