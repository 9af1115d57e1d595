#!/usr/bin/env bash
# The paper's speech experiment (§4.1: Figure 1, Tables 1 and 2) in its regime, scaled to a
# 2-core CPU: long-form real speech (about 780 encoder steps on average, up to 2,500), a plain
# transformer CTC phone recognizer, and the paper's grid of attentions trained at equal
# compute budgets. The grid spans several sittings on machines that keep nothing between
# them, so each model is measured as soon as it is trained and its results are kept in
# RESULTS (committed), from which the tables and figures are made; a model with results
# there is not trained again.
#
# 1. Long-form corpora (`asr join`): each speaker's consecutive clips of the two games'
#    voice tracks (scripts/get-real-speech.sh) and of the bundled corpus, joined with 0.25 s
#    pauses into utterances of 15–90 s, in data/long/{sky,queen,corpus}.
# 2. The machine's speed, before the sitting's first training: one epoch of full-4
#    (OUT_DIR/calibration), training and validation. Each model's budget is BUDGET minutes
#    scaled by that epoch's time over full-4's on the machine of the first sitting (140.6 s,
#    the mean of its first two epochs, on an AMD EPYC with 2 CPUs), so a slower machine
#    trains longer; each model's machine, epoch time and budget go in
#    RESULTS/calibration.tsv.
# 3. The grid, each model `asr train` with that --time-budget on both cores: full at 3
#    depths; improved clustered (i-clustered) at 2 depths × 100 and 200 clusters; clustered
#    at 100, 200 and 300 clusters; position blocks (blocks:100, the reviewers' baseline);
#    Reformer's lsh-1 and lsh-4; shared-full. Models in OUT_DIR/models/<name>; an
#    interrupted one resumes from its last epoch within the sitting.
# 4. Right after each model: its row of Table 2 and point of Figure 1 (`asr compare
#    --save`: time per epoch, curve of dev PER, test PER, forward time) as RESULTS/<name>.json;
#    for the models of Table 1's columns (full, shared-full, lsh-1, lsh-4, clustered-100,
#    i-clustered-100) their column (`asr eval --table --save`, dev, every attention) as
#    RESULTS/<name>.table1.json; for i-clustered-100 and blocks-100, which steps share a
#    cluster on the first Queen dev utterance (`asr clusters`), RESULTS/clusters-<name>.md.
# 5. The tables and Figure 1 from everything in RESULTS: table1.md, table2.md, figure1.svg.
#
# Usage: scripts/paper-tables.sh [OUT_DIR] (default runs/paper-long). Environment: BUDGET
# (minutes per model on the first sitting's machine, 30), ONLY (train only the models whose
# names match this regex; for running the grid in chunks), TRAIN (0: no training, only step
# 5), RESULTS (docs/paper/grid), BACKEND (flex), DEVICES (cpu:2).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${TRAIN:-1}" = 0 ] && [ -n "${ONLY:-}" ]; then
    echo "paper-tables: ONLY chooses models to train and TRAIN=0 trains none; give one of them" >&2
    exit 2
fi
out="${1:-runs/paper-long}"
budget="${BUDGET:-30}"
results="${RESULTS:-docs/paper/grid}"
backend="${BACKEND:-flex}"
devices="${DEVICES:-cpu:2}"
mkdir -p "$out/models" "$results"

cargo build --release --locked -p asr-model
asr="${CARGO_TARGET_DIR:-target}/release/asr"

# 1. The long-form corpora (for training and measuring; the tables need none).
corpora=()
if [ "${TRAIN:-1}" != 0 ]; then
    ASR_BIN="$asr" bash scripts/get-real-speech.sh
    for source in data/games/sky data/games/queen data/corpus; do
        long="data/long/$(basename "$source")"
        if [ ! -f "$long/README.md" ]; then
            rm -rf "$long" "$long.partial"
            "$asr" join --corpus "$source" --out "$long.partial" --mean-seconds 33 --seed 0 \
                | tee "$out/join-$(basename "$source").txt"
            mv "$long.partial" "$long"
        fi
        corpora+=(--corpus "$long")
    done
fi

# 3. The grid (`grid`), the plain transformer (`model`) and its training (`training`).
source scripts/paper-grid.sh
column_models="full-4 shared-full-4 lsh-1-4 lsh-4-4 clustered-100-4 improved-100-4"
cluster_models="improved-100-4 blocks-100-4"
# Whether the name $1 is one of the space-separated names $2.
one_of() { [[ " $2 " == *" $1 "* ]]; }
# Whether a model's results are all in RESULTS (its row is written last).
measured() {
    [ -f "$results/$1.json" ] || return 1
    if one_of "$1" "$column_models"; then [ -f "$results/$1.table1.json" ] || return 1; fi
    if one_of "$1" "$cluster_models"; then [ -f "$results/clusters-$1.md" ] || return 1; fi
}

# Step 4 for one trained model.
measure() {
    local name=$1 dir=$2
    if one_of "$name" "$column_models"; then
        "$asr" eval "${corpora[@]}" --split dev --backend "$backend" --table --clusters 100 \
            --topk 32 --model "$dir" --save "$results" || return 1
    fi
    if one_of "$name" "$cluster_models"; then
        "$asr" clusters --model "$dir" --corpus data/long/queen --split dev \
            --svg "$out/clusters-$name.svg" >"$results/clusters-$name.md.partial" || return 1
        mv "$results/clusters-$name.md.partial" "$results/clusters-$name.md" || return 1
    fi
    # Last: its file marks the model as done.
    "$asr" compare "${corpora[@]}" --backend "$backend" --batch-frames 12000 \
        --model "$dir" --save "$results"
}

# 2. The machine's speed, once per sitting, before its first training: sets `seconds`
# (full-4's epoch here), `scaled` (the budget in minutes here) and `machine`.
reference_seconds=140.6
calibrate() {
    [ -n "${scaled:-}" ] && return 0
    local calibration="$out/calibration"
    if [ ! -f "$calibration/training.json" ]; then
        echo "paper-tables: timing one epoch of full-4 on this machine"
        mkdir -p "$calibration"
        if ! "$asr" train "${corpora[@]}" --out "$calibration" --attention full --n-layers 4 \
            "${model[@]}" "${training[@]}" --epochs 1 >"$calibration.log" 2>&1; then
            echo "paper-tables: the timing epoch failed (see $calibration.log)" >&2
            exit 1
        fi
    fi
    seconds=$(python3 -c 'import json, sys
e = json.load(open(sys.argv[1]))["epochs"][0]
print("%.1f" % (e["train_seconds"] + e["valid_seconds"]))' "$calibration/training.json")
    scaled=$(python3 -c 'import sys; b, s, r = map(float, sys.argv[1:]); print(f"{b * s / r:.2f}")' \
        "$budget" "$seconds" "$reference_seconds")
    machine="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) CPUs"
    echo "paper-tables: full-4 takes $seconds s per epoch here ($reference_seconds s on the first machine): $scaled min per model"
    if [ ! -f "$results/calibration.tsv" ]; then
        printf 'model\tdate (UTC)\tmachine\tfull-4 s per epoch\tbudget (min)\n' \
            >"$results/calibration.tsv"
    fi
}

for entry in "${grid[@]}"; do
    [ "${TRAIN:-1}" = 0 ] && break
    read -r name kind layers <<<"$entry"
    if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then
        continue
    fi
    if measured "$name"; then
        echo "paper-tables: $name was trained and measured ($results/$name.json)"
        continue
    fi
    dir="$out/models/$name"
    calibrate
    if [ ! -f "$dir/training.json" ]; then
        echo "paper-tables: training $name ($kind, $layers layers, $scaled min)"
        mkdir -p "$dir"
        if ! "$asr" train "${corpora[@]}" --out "$dir" --attention "$kind" --n-layers "$layers" \
            "${model[@]}" "${training[@]}" --epochs 1000 --time-budget "$scaled" --resume \
            >>"$dir.log" 2>&1; then
            echo "paper-tables: training $name failed (see $dir.log); the tables leave it out" >&2
            continue
        fi
        tail -n 4 "$dir.log"
    fi
    if measure "$name" "$dir"; then
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$(date -u +%F)" "$machine" "$seconds" "$scaled" \
            >>"$results/calibration.tsv"
    else
        echo "paper-tables: measuring $name failed; it is measured again on the next run" >&2
    fi
done

# 5. The tables and Figure 1 from the saved results.
rows=()
for entry in "${grid[@]}"; do
    read -r name _ <<<"$entry"
    if measured "$name"; then rows+=(--saved "$results/$name.json"); fi
done
columns=()
for name in $column_models; do
    if [ -f "$results/$name.table1.json" ]; then columns+=(--saved "$results/$name.table1.json"); fi
done
if [ ${#columns[@]} -gt 0 ]; then
    "$asr" eval --backend "$backend" --table "${columns[@]}" >"$results/table1.md.partial"
    mv "$results/table1.md.partial" "$results/table1.md"
    cat "$results/table1.md"
fi
if [ ${#rows[@]} -gt 0 ]; then
    "$asr" compare --backend "$backend" "${rows[@]}" --svg "$results/figure1.svg" \
        --caption "long-form real speech, $backend, ${budget} min per model at the first machine's speed: dev PER against forward time and training time" \
        >"$results/table2.md.partial"
    mv "$results/table2.md.partial" "$results/table2.md"
    cat "$results/table2.md"
fi
