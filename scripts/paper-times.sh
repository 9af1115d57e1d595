#!/usr/bin/env bash
# The times of the paper's grid (docs/paper-tables.md) measured again in one sitting, without
# training the grid again:
# 1. Three rounds of two epochs each of full-4, clustered-100-4 and improved-100-4 with their
#    grid commands (no budget), the order rotated each round, each round followed by `asr
#    compare` of its three models: training seconds per epoch (each model's epochs.jsonl) and
#    forward time per dev utterance (docs: "Three rounds of epochs in one sitting").
# 2. Each of the grid's 14 models trained for one epoch, then `asr compare` of all 14 in one
#    process, three times, the second in the reverse order (docs: "The grid's forward times
#    on Burn 0.22"). The forward pass's cost does not depend on what the weights have learned.
# It resumes: a model with its epochs done and a comparison with its output are skipped. Run it
# on a quiet machine (about 40 minutes on 2 cores).
#
# Usage: scripts/paper-times.sh [OUT_DIR] (default runs/paper-times). Needs the long-form
# corpora in data/long (scripts/paper-tables.sh makes them). Environment: ASR_BIN (an asr
# binary to use instead of building one), BACKEND (flex), DEVICES (cpu:2).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-runs/paper-times}"
backend="${BACKEND:-flex}"
devices="${DEVICES:-cpu:2}"
source scripts/paper-grid.sh
for corpus in sky queen corpus; do
    if [ ! -f "data/long/$corpus/README.md" ]; then
        echo "paper-times: data/long/$corpus is missing: scripts/paper-tables.sh makes the long-form corpora" >&2
        exit 1
    fi
done
corpora=(--corpus data/long/sky --corpus data/long/queen --corpus data/long/corpus)
asr="${ASR_BIN:-}"
if [ -z "$asr" ]; then
    cargo build --release --locked -p asr-model
    asr="${CARGO_TARGET_DIR:-target}/release/asr"
fi

# Trains grid model $1 (its grid entry's name) into $2 for $3 epochs, unless done there.
train() {
    local name=$1 dir=$2 epochs=$3 entry entry_name kind layers
    if [ -f "$dir/epochs.jsonl" ] && [ "$(wc -l <"$dir/epochs.jsonl")" -ge "$epochs" ]; then
        return 0
    fi
    for entry in "${grid[@]}"; do
        read -r entry_name kind layers <<<"$entry"
        [ "$entry_name" = "$name" ] && break
    done
    if [ "$entry_name" != "$name" ]; then
        echo "paper-times: $name is not in the grid (scripts/paper-grid.sh)" >&2
        exit 1
    fi
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "paper-times: training $name for $epochs epoch(s) in $dir"
    "$asr" train "${corpora[@]}" --out "$dir" --attention "$kind" --n-layers "$layers" \
        "${model[@]}" "${training[@]}" --epochs "$epochs" >"$dir.log" 2>&1 || {
        echo "paper-times: training $name failed (see $dir.log)" >&2
        exit 1
    }
}

# `asr compare` of the model directories $2… into $1, unless done.
compare() {
    local file=$1
    shift
    [ -f "$file" ] && return 0
    echo "paper-times: asr compare of $(($# / 2)) models into $file"
    "$asr" compare "${corpora[@]}" --backend "$backend" --batch-frames 12000 "$@" >"$file.partial"
    mv "$file.partial" "$file"
}

# 1. Three rounds.
orders=("full-4 clustered-100-4 improved-100-4" "clustered-100-4 improved-100-4 full-4"
    "improved-100-4 full-4 clustered-100-4")
for round in 1 2 3; do
    dirs=()
    for name in ${orders[round - 1]}; do
        train "$name" "$out/rounds/r$round/$name" 2
        dirs+=(--model "$out/rounds/r$round/$name")
    done
    compare "$out/rounds/compare-r$round.txt" "${dirs[@]}"
done

# 2. The grid's 14 models, one epoch each, compared three times.
dirs=()
for entry in "${grid[@]}"; do
    read -r name _ <<<"$entry"
    train "$name" "$out/grid/$name" 1
    dirs+=(--model "$out/grid/$name")
done
reversed=()
for ((i = ${#dirs[@]} - 2; i >= 0; i -= 2)); do reversed+=("${dirs[i]}" "${dirs[i + 1]}"); done
compare "$out/grid/compare-r1.txt" "${dirs[@]}"
compare "$out/grid/compare-r2.txt" "${reversed[@]}"
compare "$out/grid/compare-r3.txt" "${dirs[@]}"

# The figures: training seconds of each round's epochs, then the comparisons' tables.
for round in 1 2 3; do
    for name in full-4 clustered-100-4 improved-100-4; do
        printf 'round %s %s: training seconds per epoch: ' "$round" "$name"
        grep -o '"train_seconds":[0-9.]*' "$out/rounds/r$round/$name/epochs.jsonl" \
            | cut -d: -f2 | tr '\n' ' '
        echo
    done
done
for file in "$out"/rounds/compare-r*.txt "$out"/grid/compare-r*.txt; do
    echo "$file:"
    grep '^|' "$file"
done
