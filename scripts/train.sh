#!/usr/bin/env bash
# The main job: trains the ASR example (improved clustered attention) on the bundled corpus
# (data/corpus) on the default CPU backend (Flex), then prints the test phone error rate and
# where the model is, and the phone error rate on the bundled real recordings (data/real).
# No system package is needed. Extra arguments go to `asr train`
# (see `cargo run --release -p asr-model -- train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p asr-model
bin="${CARGO_TARGET_DIR:-target}/release/asr"
"$bin" train --corpus data/corpus --out runs/improved --also-test data/real/test.jsonl "$@"
