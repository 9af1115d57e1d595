#!/usr/bin/env bash
# The paper's speech experiment (§4.1: Figure 1, Tables 1 and 2) in its regime, scaled to a
# 2-core CPU: long-form real speech (about 780 encoder steps on average, up to 2,500), a plain
# transformer CTC phone recognizer, and the paper's grid of attentions trained at equal
# wall-clock budgets. Resumable: run it again after an interruption and it goes on where it
# stopped (finished models are kept, an interrupted one resumes from its last epoch).
#
# 1. Long-form corpora (`asr join`): each speaker's consecutive clips of the two games'
#    voice tracks (scripts/get-real-speech.sh) and of the bundled corpus, joined with 0.25 s
#    pauses into utterances of 15–90 s, in data/long/{sky,queen,corpus}.
# 2. The grid, each model `asr train` with --time-budget BUDGET minutes on both cores:
#    full at 3 depths; improved clustered (i-clustered) at 2 depths × 100 and 200 clusters;
#    clustered at 100, 200 and 300 clusters; position blocks (blocks:100, the reviewers'
#    baseline); Reformer's lsh-1 and lsh-4; shared-full. Models in OUT_DIR/models/<name>.
# 3. Table 1 (`asr eval --table`, dev): the models of the paper's columns (full, shared-full,
#    lsh-1, lsh-4, clustered-100, i-clustered-100) evaluated with every
#    attention; Table 2 and Figure 1 (`asr compare`): time per epoch, time to a common dev
#    PER, test PER, forward time; SVG of dev PER against forward time and training time.
# 4. The clusters of one dev utterance per layer and head (`asr clusters`), for
#    i-clustered and blocks.
#
# Usage: scripts/paper-tables.sh [OUT_DIR] (default runs/paper-long). Environment: BUDGET
# (minutes per model, 30), ONLY (train only the models whose names match this regex, then
# stop; for running the grid in chunks), TRAIN (0: no training, the tables and figures of the
# models trained so far), BACKEND (flex), DEVICES (cpu:2).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${TRAIN:-1}" = 0 ] && [ -n "${ONLY:-}" ]; then
    echo "paper-tables: ONLY chooses models to train and TRAIN=0 trains none; give one of them" >&2
    exit 2
fi
out="${1:-runs/paper-long}"
budget="${BUDGET:-30}"
backend="${BACKEND:-flex}"
devices="${DEVICES:-cpu:2}"
mkdir -p "$out/models"

cargo build --release --locked -p asr-model
asr="${CARGO_TARGET_DIR:-target}/release/asr"

# 1. The long-form corpora.
ASR_BIN="$asr" bash scripts/get-real-speech.sh
corpora=()
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

# 2. The grid: name, attention, layers, the models the tables need most first. The paper's
# 4, 6 and 9 layers become 2, 3 and 4.
grid=(
    "full-4 full 4"
    "clustered-100-4 clustered:100 4"
    "improved-100-4 improved:100:32 4"
    "shared-full-4 shared-full 4"
    "lsh-1-4 lsh:1 4"
    "lsh-4-4 lsh:4 4"
    "blocks-100-4 blocks:100 4"
    "improved-200-4 improved:200:32 4"
    "clustered-200-4 clustered:200 4"
    "full-3 full 3"
    "improved-100-3 improved:100:32 3"
    "full-2 full 2"
    "improved-200-3 improved:200:32 3"
    "clustered-300-4 clustered:300 4"
)
# The plain transformer: stacked frames (4 per step), no convolution module, fixed
# sinusoidal positions; ReLU (Flex evaluates GELU's erf one element at a time).
model=(--front-end stack --subsampling 4 --conv-kernel 0 --d-model 128 --n-heads 4
    --d-ff 512 --activation relu --dropout 0)
training=(--ctc-loss alpha-beta --augment none --batch-frames 6000 --learning-rate 1e-3
    --warmup-steps 200 --epochs 1000 --time-budget "$budget" --devices "$devices"
    --backend "$backend" --seed 0)
if [ "${TRAIN:-1}" = 0 ]; then
    grid_to_train=()
else
    grid_to_train=("${grid[@]}")
fi
for entry in ${grid_to_train[@]+"${grid_to_train[@]}"}; do
    read -r name kind layers <<<"$entry"
    if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then
        continue
    fi
    dir="$out/models/$name"
    if [ -f "$dir/training.json" ]; then
        echo "paper-tables: $name is trained ($dir)"
        continue
    fi
    echo "paper-tables: training $name ($kind, $layers layers, $budget min)"
    mkdir -p "$dir"
    if "$asr" train "${corpora[@]}" --out "$dir" --attention "$kind" --n-layers "$layers" \
        "${model[@]}" "${training[@]}" --resume >>"$dir.log" 2>&1; then
        tail -n 4 "$dir.log"
    else
        echo "paper-tables: training $name failed (see $dir.log); the tables leave it out" >&2
    fi
done
if [ -n "${ONLY:-}" ]; then
    exit 0
fi

# 3. The tables, on the union of the three corpora's dev splits (Table 1, Table 2's dev
# columns) and test splits (Table 2's test PER).
trained() { [ -f "$out/models/$1/training.json" ]; }
models=()
for entry in "${grid[@]}"; do
    read -r name _ <<<"$entry"
    if trained "$name"; then models+=(--model "$out/models/$name"); fi
done
# Table 1: the models of the paper's columns that are trained, evaluated with every attention.
table1=()
for name in full-4 shared-full-4 lsh-1-4 lsh-4-4 clustered-100-4 improved-100-4; do
    if trained "$name"; then table1+=(--model "$out/models/$name"); fi
done
"$asr" eval "${corpora[@]}" --split dev --backend "$backend" --table --clusters 100 \
    --topk 32 "${table1[@]}" | tee "$out/table1.md"
"$asr" compare "${corpora[@]}" --backend "$backend" --batch-frames 12000 "${models[@]}" \
    --svg "$out/figure1.svg" \
    --caption "long-form real speech, $backend, ${budget} min per model: dev PER against forward time and training time" \
    | tee "$out/table2.md"

# 4. Which steps share a cluster, on the first dev utterance of the Queen corpus.
for name in improved-100-4 blocks-100-4; do
    trained "$name" || continue
    "$asr" clusters --model "$out/models/$name" --corpus data/long/queen --split dev \
        --svg "$out/clusters-$name.svg" | tee "$out/clusters-$name.md"
done
