#!/usr/bin/env bash
# The main job: trains the ASR example (improved clustered attention) on the default CPU backend
# (Flex), one worker per core (`--devices cpu:N`), on real recorded English speech mixed with the
# bundled synthesized corpus (data/corpus). First it installs the Debian packages the job needs
# (scripts/system-packages/main-job.txt: espeak-ng, which labels the games' transcripts with
# phones; as root or through sudo). The real speech is the voice tracks of two freeware games in
# Debian's archive, fetched, unpacked and imported by scripts/get-real-speech.sh (data/games/;
# their dev and test speakers or scenes are never heard in training). Where the packages cannot be
# installed or the games cannot be fetched, it prints why and trains on the bundled corpus alone,
# and its last line says so and what that costs; with ASR_REQUIRE_GAMES=1 it fails instead. It
# ends with the phone error rate on each corpus's test split (synthetic voices; the games'
# held-out speakers and scenes), on the bundled real recordings (data/real, never trained on), and
# the model's directory (runs/improved); with the games, then the same test sets decoded with a
# phone language model (`asr eval --lm-corpus`).
#
# EPOCHS sets the number of epochs (default: 14 with the games, 40 without). Extra arguments go
# to `asr train` (see `cargo run --release -p asr-model -- train --help`), an option among them
# in place of the script's own (e.g. `--devices cpu:1`, `--out runs/full`). ASR_BIN names an asr
# binary to use instead of building one (release); PHONE_LM=0 skips the decoding with the phone
# language model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/system-packages/install.sh
packages=1
install_system_packages scripts/system-packages/main-job.txt || packages=0
bin=${ASR_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release --locked -p asr-model
    bin="${CARGO_TARGET_DIR:-target}/release/asr"
fi
cores=$(nproc 2>/dev/null || echo 1)

# What training without the games costs: this script's fallback on a fresh machine
# (2026-12-01, 40 epochs on the bundled corpus) scored 73.53 % on data/real; README's figures
# are the main job's with the games.
without_games="the games' speech was NOT used: this model is trained on the bundled synthesized corpus alone and scores about 73.5 % PER on data/real, where the main job with the games scores 36.76 % (35.29 % with the phone LM)"
# The options the arguments give (`--name` or `--name=value`) and the model's directory
# (`--out`, runs/improved unless given): the script's own value of an option the arguments give
# is left out, so that the arguments choose (`asr train` rejects an option given twice).
given=" "
out=
prev=
for arg in "$@"; do
    case "$arg" in --*) given+="${arg%%=*} " ;; esac
    [ "$prev" = --out ] && out=$arg
    case "$arg" in --out=*) out=${arg#--out=} ;; esac
    prev=$arg
done
args=()
# option NAME VALUE: adds NAME VALUE to `asr train`'s arguments unless the arguments give NAME.
option() { [[ "$given" == *" $1 "* ]] || args+=("$@"); }
games=0
if [ "$packages" = 0 ]; then
    echo "train.sh: the main job's system packages are missing (see above): the games cannot be imported" >&2
elif ASR_BIN="$bin" bash scripts/get-real-speech.sh; then
    games=1
    # Real speech: a convolutional front end and a Conformer convolution module in every
    # layer, ReLU in the feed-forward blocks (Flex's GELU computes erf one element at a time,
    # the slower the larger the inputs grow in training), an intermediate CTC loss on the
    # middle layer (weight 0.3), batches of 4,000 frames, a higher learning rate with a short
    # warm-up and a linear decay to 0 at the last step, only speed perturbation (the recordings
    # are degraded already; SpecAugment slowed learning more than 14 epochs can make up), and
    # no dropout (within 20 minutes the model is far from overfitting, and steps without it
    # are faster). Both CTC losses are `asr train`'s default, the alpha-beta recursions on the
    # host: epochs about a tenth shorter than with burn-nn's `CTCLoss` (docs/asr-real-speech.md).
    corpora=(data/corpus data/games/sky data/games/queen)
    args=("${corpora[@]/#/--corpus=}")
    option --front-end conv:128
    option --conv-kernel 15
    option --activation relu
    option --inter-ctc 0.3
    option --epochs "${EPOCHS:-14}"
    option --batch-frames 4000
    option --learning-rate 3e-3
    option --warmup-steps 100
    option --final-learning-rate 0
    option --augment speed
    option --dropout 0
fi
if [ "$games" = 0 ]; then
    if [ "${ASR_REQUIRE_GAMES:-0}" = 1 ]; then
        echo "train.sh: the games' speech is not available (see above), and ASR_REQUIRE_GAMES=1" >&2
        exit 1
    fi
    echo "train.sh: the games' speech is not available (see above): training on the bundled corpus alone" >&2
    args=(--corpus data/corpus)
    option --epochs "${EPOCHS:-40}"
fi
option --devices "cpu:$cores"
option --out runs/improved
out=${out:-runs/improved}
"$bin" train "${args[@]}" --also-test data/real/test.jsonl "$@"

if [ "$games" = 1 ] && [ "${PHONE_LM:-1}" != 0 ]; then
    # The same test sets decoded by CTC prefix beam search with a phone 5-gram LM counted on the
    # three corpora's training transcripts (its weight, insertion bonus and beam were chosen on
    # their dev splits), in the directory the model was written to.
    for corpus in "${corpora[@]}" data/real; do
        "$bin" eval --model "$out" --corpus "$corpus" --split test "${corpora[@]/#/--lm-corpus=}"
    done
fi
if [ "$games" = 0 ]; then
    echo "train.sh: $without_games" >&2
fi
