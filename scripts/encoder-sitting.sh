#!/usr/bin/env bash
# The encoder table of docs/bench/encoder.md in one sitting: one training step of the 4-layer
# encoder (d_model 256, 8 heads, d_ff 1024, batch 1, dropout 0.1), this crate's on Flex with
# improved attention with and without its layers recomputed (`bench --mode encoder`), then
# PyTorch's `nn.TransformerEncoder` and fast-transformers' encoder of the same shape
# (scripts/torch_encoder_bench.py, in a Python environment that has torch and
# pytorch-fast-transformers: PYTHON), every configuration in its own process under the same
# data-segment cap. Lengths 4,096, 16,384 and 65,536 take the median of 2 steps after 1
# untimed; 262,144 (ours) and PyTorch's 65,536 one step, untimed none (a step there takes
# minutes). It resumes: a part with its output is skipped. Run it on a quiet machine (about 40
# minutes on 2 cores).
#
# Usage: scripts/encoder-sitting.sh [OUT_DIR] (default runs/encoder-sitting). Environment:
# BENCH_BIN (a bench binary built with `--no-default-features --features flex`, instead of
# building one), PYTHON (default /tmp/ptenv/bin/python), MEMORY_GIB (the cap, default 16).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-runs/encoder-sitting}"
python="${PYTHON:-/tmp/ptenv/bin/python}"
cap="${MEMORY_GIB:-16}"
bench="${BENCH_BIN:-}"
if [ -z "$bench" ]; then
    cargo build --release --locked -p bench --no-default-features --features flex
    bench="${CARGO_TARGET_DIR:-target}/release/bench"
fi
mkdir -p "$out"

# Ours: $1 name, $2 lengths, $3 runs, $4 warmup.
ours() {
    [ -f "$out/$1.json" ] && return
    "$bench" --mode encoder --backends flex --only improved,improved-recompute \
        --lengths "$2" --runs "$3" --warmup "$4" --memory-gib "$cap" \
        --out-dir "$out" --name "$1" | tee "$out/$1.log"
}
ours encoder-flex 4096,16384,65536 2 1
ours encoder-flex-262144 262144 1 0

# PyTorch's and fast-transformers' (the script resumes from its JSON lines).
"$python" scripts/torch_encoder_bench.py --lengths 4096,16384 --runs 2 --warmup 1 \
    --memory-gib "$cap" --out "$out/torch-encoder.jsonl"
"$python" scripts/torch_encoder_bench.py --lengths 65536 --runs 1 --warmup 0 \
    --only torch,torch-checkpoint,torch-dropout,torch-dropout-checkpoint --memory-gib "$cap" \
    --out "$out/torch-encoder.jsonl"
"$python" scripts/torch_encoder_bench.py --lengths 65536 --runs 2 --warmup 1 \
    --only fast-transformers --memory-gib "$cap" --out "$out/torch-encoder.jsonl"
echo "encoder sitting: done in $SECONDS s ($out)"
