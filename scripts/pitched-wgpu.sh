#!/usr/bin/env bash
# Runs the WGPU tests of clustered-attention's kernels with WGPU allocating tensors the way CUDA
# does, on any machine (Mesa's lavapipe where there is no GPU).
#
# On CUDA, cubecl's `PitchedMemoryLayoutPolicy` pads each row of the tensors that Burn
# allocates (`empty`, `zeros`, `from_data`, ...) to a power-of-two pitch of 16 bytes up to the
# device's buffer alignment; WGPU's `ContiguousMemoryLayoutPolicy` does not. A kernel that
# indexes such a tensor as if it were contiguous, or writes into an output that Burn
# allocated, gives wrong values or out-of-bounds accesses on CUDA only. This script copies
# cubecl-wgpu's source out of Cargo's registry, applies `scripts/pitched-wgpu.patch` (WGPU gets
# the pitched policy, and its reads and writes copy pitched rows), and runs the suite's tests
# of the kernels on WGPU against it through a `[patch]` given on the command line: the hashing
# and K-means kernels (`gpu::wgpu::`, fused, unfused, under Autodiff and in half precision) and
# the top-k, softmax, sparse-product, centroid- and top-k-attention ops and their gradients
# (`sparse::wgpu…`). The attention-level WGPU tests, which compose the same kernels, run once,
# in the main pass. Cargo.lock is restored afterwards. Arguments go to the test binary (e.g.
# `--test-threads 1`).
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.10.0
manifest=$(cargo metadata --format-version 1 --locked \
    | grep -o "\"manifest_path\":\"[^\"]*/cubecl-wgpu-$version/Cargo.toml\"" \
    | head -n 1 | cut -d '"' -f 4 || true)
if [ -z "$manifest" ]; then
    echo "pitched-wgpu: cubecl-wgpu $version is not in Cargo.lock; update scripts/pitched-wgpu.patch" >&2
    exit 1
fi

target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target/pitched-wgpu"
dir="$(cd "$target/pitched-wgpu" && pwd)/cubecl-wgpu-$version"
# A fresh copy only when the patch changed: Cargo rebuilds a path dependency (and all of Burn
# above it) when its files are newer than its last build.
stamp=$(cksum < scripts/pitched-wgpu.patch)
if [ ! -f "$dir.stamp" ] || [ "$(cat "$dir.stamp")" != "$stamp" ]; then
    rm -rf "$dir" "$dir.stamp"
    cp -r "$(dirname "$manifest")" "$dir"
    patch --quiet --strip 1 --directory "$dir" < scripts/pitched-wgpu.patch
    echo "$stamp" > "$dir.stamp"
fi

# The `[patch]` changes cubecl-wgpu's source in Cargo.lock; put the file back however this ends.
cp Cargo.lock "$dir.lock"
trap 'cp "$dir.lock" Cargo.lock' EXIT

export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"
# The features of scripts/test.sh, so that only cubecl-wgpu and what depends on it are rebuilt.
cargo test --workspace --features clustered-attention/wgpu,clustered-attention/cuda \
    --test suite --config "patch.crates-io.cubecl-wgpu.path=\"$dir\"" -- \
    gpu::wgpu:: sparse::wgpu --skip gpu::wgpu::forwards_read_nothing_back "$@"
