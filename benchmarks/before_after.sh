#!/usr/bin/env bash
# This tree's server against another tree's (BASE: a checkout, e.g. `git worktree add /tmp/base <commit>`),
# both on this venv, taking turns in ABBA order (base, new, new, base; ROUNDS=2 gives ABBAABBA), the same
# two cells as peers.sh: c1 (8 requests one at a time, 128 tokens out) and mixed (64 requests, 32
# concurrent). Prints each tree's medians over its runs and the ratios new / base; the summary goes to
# benchmarks/results/before-after[-MODEL]/summary.json, per-run files to RAW (ignored by git).
#   BASE=/tmp/base bash benchmarks/before_after.sh
#   BASE=/tmp/base MODEL=qwen2.5-coder-0.5b bash benchmarks/before_after.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:?BASE: the other tree (a git worktree of the commit to compare with)}
MODEL=${MODEL:-}
ROUNDS=${ROUNDS:-1}
OUT=${OUT:-benchmarks/results/before-after${MODEL:+-$MODEL}}
RAW=${RAW:-benchmarks/runs/$(basename "$OUT")}
mkdir -p "$OUT" "$RAW"
if [[ -n $MODEL ]]; then
    GGUF=$(.venv/bin/python -c "import sys; from tokenloom.model import catalog; print(catalog.pull(sys.argv[1], progress=False))" "$MODEL")
else
    GGUF=$(.venv/bin/python -c "from tokenloom.model.load import model_path; print(model_path(None))")
fi
PORT=8124
run() {  # tree label
    local tree=$1 label=$2
    PYTHONPATH=$tree .venv/bin/tokenloom serve --model "$GGUF" --served-model-name m --port $PORT \
        --quantization auto >"$RAW/$label.log" 2>&1 &
    local pid=$!
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
    for cell in warmup c1 mixed; do
        case $cell in
            warmup) args=(--dataset random --num-prompts 2 --output-len 8) ;;
            c1) args=(--dataset random --num-prompts 8 --max-concurrency 1 --output-len 128) ;;
            mixed) args=(--dataset mixed --num-prompts 64 --max-concurrency 32) ;;
        esac
        .venv/bin/tokenloom bench serve --base-url "http://127.0.0.1:$PORT" --model m --no-progress \
            --no-align-prompts --input-len 128 --seed 0 --out "$RAW/$label-$cell.json" "${args[@]}" >/dev/null
    done
    kill $pid; wait $pid 2>/dev/null || true
    sleep 2
}
labels=()
for r in $(seq "$ROUNDS"); do
    for who in base new new base; do
        tree=$([[ $who == base ]] && echo "$BASE" || pwd)
        label=$who-$r-$((${#labels[@]} % 4))
        echo "== $label ($tree)"
        run "$tree" "$label"
        labels+=("$label")
    done
done
.venv/bin/python - "$OUT" "$RAW" "$BASE" "${MODEL:-smollm2-135m}" "${labels[@]}" <<'PY'
import json, statistics, subprocess, sys
out, raw, base, model, *labels = sys.argv[1:]
def cell(label, name, key):
    return json.load(open(f"{raw}/{label}-{name}.json"))[key]
rows = {}
for who in ("base", "new"):
    runs = [label for label in labels if label.startswith(who)]
    rows[who] = {"runs": len(runs),
                 "c1_tpot_p50_ms": statistics.median(cell(r, "c1", "median_tpot_ms") for r in runs),
                 "c1_ttft_p50_ms": statistics.median(cell(r, "c1", "median_ttft_ms") for r in runs),
                 "mixed_output_tok_s": statistics.median(cell(r, "mixed", "output_throughput") for r in runs)}
ratios = {k: rows["new"][k] / rows["base"][k] for k in rows["new"] if k != "runs"}
commit = subprocess.run(["git", "-C", base, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
summary = {"command": f"BASE=<worktree of {commit}> MODEL={model} bash benchmarks/before_after.sh", "model": model,
           "base_commit": commit, "new_commit": head, "order": labels, "servers": rows, "new_over_base": ratios}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
