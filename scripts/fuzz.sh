#!/usr/bin/env bash
# The long fuzz campaign of the readers of bytes from outside, in the test build (debug
# assertions and overflow checks on), two targets at a time:
# - asr-data's `fuzz` tests (the games' files, manifests, audio, asr manifest's transcript
#   files): CASES inputs per target (default 1,000,000);
# - asr-model's (the model directory) and text-encoder's (the checkpoint, its config and
#   tokenizer), which build a model per input: MODEL_CASES inputs per target (default CASES);
# all drawn from seed SEED (default 1). Prints each target's count of inputs; a failing input
# is written under the target directory's tmp/ and named in the failure. The targets write
# their inputs to temporary files: TMPDIR defaults to /dev/shm where it can be written (on a
# disk, the file system's journal is most of the time). CI runs the same targets for 300
# inputs each, seed 0.
#   bash scripts/fuzz.sh [CASES] [SEED] [MODEL_CASES]
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-1000000}
seed=${2:-1}
model_cases=${3:-$cases}
if [ -z "${TMPDIR:-}" ] && [ -w /dev/shm ]; then
    export TMPDIR=/dev/shm
fi
start=$SECONDS
export FUZZ_SEED=$seed
FUZZ_CASES=$cases cargo test --locked -p asr-data --test fuzz -- --nocapture --test-threads 2
FUZZ_CASES=$model_cases cargo test --locked -p asr-model --test fuzz -- --nocapture --test-threads 2
FUZZ_CASES=$model_cases cargo test --locked -p text-encoder --lib fuzz:: -- --nocapture --test-threads 2
echo "fuzz campaign: $cases inputs per target ($model_cases for the model directory and the text encoder), seed $seed, $((SECONDS - start)) s"
