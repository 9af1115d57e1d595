#!/usr/bin/env bash
# The paper's Table 1, Table 2 and Figure 1 on a long-utterance synthetic corpus: trains one
# model per attention (full, shared-full, lsh:1, lsh:4, clustered:C, improved:C:K) on the same
# budget, then prints the cross evaluation (asr eval --table) and the convergence table
# (asr compare), and draws dev PER against forward time.
#
# Usage: scripts/paper-tables.sh [OUT_DIR] (default runs/paper). Environment: EPOCHS (20),
# JOBS (2 trainings at a time; the Flex backend keeps about one core busy), BACKEND (flex),
# HOURS (0.4), MIN_SECONDS (16: about 430 encoder steps at time subsampling 4),
# CLUSTERS (C, 54 ≈ mean encoder steps / 8), TOPK (32).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-runs/paper}"
epochs="${EPOCHS:-20}"
jobs="${JOBS:-2}"
backend="${BACKEND:-flex}"
clusters="${CLUSTERS:-54}"
topk="${TOPK:-32}"
mkdir -p "$out"

cargo build --release -p asr-model
asr="${CARGO_TARGET_DIR:-target}/release/asr"

corpus="$out/corpus"
if [ ! -f "$corpus/test.jsonl" ]; then
    "$asr" corpus --out "$corpus" --hours "${HOURS:-0.4}" --held-out-fraction 0.15 \
        --min-seconds "${MIN_SECONDS:-16}" --seed 1
fi

kinds=(lsh:4 full shared-full lsh:1 "improved:$clusters:$topk" "clustered:$clusters")
train() {
    local kind="$1"
    local dir="$out/models/${kind//:/-}"
    "$asr" train --corpus "$corpus" --out "$dir" --backend "$backend" --attention "$kind" \
        --subsampling 4 --epochs "$epochs" --warmup-steps 100 --augment none --batch-frames 2000 \
        >"$dir.log" 2>&1
    tail -n 1 "$dir.log"
}
mkdir -p "$out/models"
running=0
for kind in "${kinds[@]}"; do
    train "$kind" &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
        wait -n
        running=$((running - 1))
    fi
done
wait

models=()
for kind in full shared-full lsh:1 lsh:4 "clustered:$clusters" "improved:$clusters:$topk"; do
    models+=(--model "$out/models/${kind//:/-}")
done
"$asr" eval --corpus "$corpus" --split dev --backend "$backend" --table \
    --clusters "$clusters" --topk "$topk" "${models[@]}" | tee "$out/table1.md"
"$asr" compare --corpus "$corpus" --backend "$backend" "${models[@]}" \
    --svg "$out/figure1.svg" --caption "dev PER against forward time ($backend)" \
    | tee "$out/table2.md"
