#!/usr/bin/env bash
# The long fuzz campaign of the readers of bytes from outside (the `fuzz` tests of asr-data:
# the games' files, manifests, audio; of asr-model: the model directory; of text-encoder: the
# checkpoint, its config and tokenizer): every target for CASES inputs (default 1,000,000) drawn from seed SEED (default 1), in the
# test build (debug assertions and overflow checks on), two targets at a time. Prints each
# target's count of inputs; a failing input is written under the target directory's tmp/
# and named in the failure. CI runs the same targets for 300 inputs each, seed 0.
#   bash scripts/fuzz.sh [CASES] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-1000000}
seed=${2:-1}
start=$SECONDS
export FUZZ_CASES=$cases FUZZ_SEED=$seed
cargo test --locked -p asr-data -p asr-model --test fuzz -- --nocapture --test-threads 2
cargo test --locked -p text-encoder --lib fuzz:: -- --nocapture --test-threads 2
echo "fuzz campaign: $cases inputs per target, seed $seed, $((SECONDS - start)) s"
