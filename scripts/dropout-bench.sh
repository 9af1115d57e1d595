#!/usr/bin/env bash
# What attention dropout costs a training step, in one sitting: `bench --mode train` with
# `--dropout 0` and `--dropout 0.1`, clustered and improved attention, L = 4,096 and 16,384, on
# Flex (medians of at least 1 s of runs) and on WGPU (lavapipe without a GPU: 3 runs, no minimum
# time), one process per cell, the two dropouts alternated within each round. With BEFORE set
# to another build's bench binary, the first two rounds run it too, with dropout 0.1. It
# resumes: a cell with its output is skipped. A cell with dropout 0.1 of a bench built from
# this tree also times a step without dropout beside each timed step (before and after it in
# turn), in the same process ("dropout N×" in its table): the measure to read where processes differ more than
# the dropout costs. Run it on a quiet machine (about 35 minutes on 2 cores, 4 rounds).
#
# Usage: scripts/dropout-bench.sh [OUT_DIR] (default runs/dropout-bench). Environment:
# BENCH_BIN (a bench binary to use instead of building one), BEFORE (a bench binary of the code
# to compare with), ROUNDS (4), BACKENDS (flex wgpu).
# Each cell's table is in OUT_DIR/log/<code>-<backend>-<attentions>-<lengths>-p<P>-r<round>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-runs/dropout-bench}"
rounds="${ROUNDS:-4}"
read -r -a backends <<<"${BACKENDS:-flex wgpu}"
bench="${BENCH_BIN:-}"
if [ -z "$bench" ]; then
    cargo build --release --locked -p bench
    bench="${CARGO_TARGET_DIR:-target}/release/bench"
fi
before="${BEFORE:-}"
mkdir -p "$out/log" "$out/out"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"

# Runs one cell: $1 code (final or before), $2 binary, $3 backend, $4 attentions, $5 lengths,
# $6 dropout, $7 round, then the backend's options.
cell() {
    local code=$1 bin=$2 backend=$3 only=$4 lengths=$5 p=$6 round=$7
    shift 7
    local name="$code-$backend-$only-$lengths-p${p/./}-r$round"
    [ -f "$out/log/$name.done" ] && return
    "$bin" --backends "$backend" --mode train --only "$only" --lengths "$lengths" --dropout "$p" \
        "$@" --out-dir "$out/out" --name "$name" >"$out/log/$name.txt" 2>&1
    touch "$out/log/$name.done"
}

for round in $(seq 1 "$rounds"); do
    for backend in "${backends[@]}"; do
        case "$backend" in
        flex | ndarray)
            for p in 0 0.1; do
                cell final "$bench" "$backend" clustered,improved 4096,16384 "$p" "$round"
            done
            if [ -n "$before" ] && [ "$round" -le 2 ]; then
                cell before "$before" "$backend" clustered,improved 4096,16384 0.1 "$round"
            fi
            ;;
        *)
            for len in 4096 16384; do
                for attention in clustered improved; do
                    for p in 0 0.1; do
                        cell final "$bench" "$backend" "$attention" "$len" "$p" "$round" \
                            --runs 3 --min-time-s 0
                    done
                    if [ -n "$before" ] && [ "$round" -le 2 ]; then
                        cell before "$before" "$backend" "$attention" "$len" 0.1 "$round" \
                            --runs 3 --min-time-s 0
                    fi
                done
            done
            ;;
        esac
    done
done
echo "dropout-bench: done; the tables are in $out/log"
