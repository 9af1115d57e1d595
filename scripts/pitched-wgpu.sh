#!/usr/bin/env bash
# Runs the WGPU tests of clustered-attention's kernels with WGPU allocating tensors the way CUDA
# does, on any machine (Mesa's lavapipe where there is no GPU).
#
# On CUDA, cubecl's `PitchedMemoryLayoutPolicy` (cubecl-server's allocator, the one cubecl-cuda
# gives its server) pads each row of the tensors that Burn allocates (`empty`, `zeros`,
# `from_data`, ...) to a power-of-two pitch of 16 bytes up to the device's buffer alignment;
# WGPU's `ContiguousMemoryLayoutPolicy` does not. A kernel that
# indexes such a tensor as if it were contiguous, or writes into an output that Burn
# allocated, gives wrong values or out-of-bounds accesses on CUDA only. This script copies
# cubecl-wgpu's source out of Cargo's registry and applies `scripts/pitched-wgpu.patch`, which
# lets WGPU choose its layout when its first device is created: its own contiguous one, or,
# with `CUBECL_WGPU_PITCHED=1` in the environment, CUDA's pitched one (its reads and writes
# then copy pitched rows). Built against that copy through a `[patch]` given on the command
# line, the suite's tests of the kernels run with the variable set: the hashing and K-means
# kernels (`gpu::wgpu::`, fused, under Autodiff and in half precision) and the top-k,
# softmax, sparse-product, centroid- and top-k-attention ops and their gradients
# (`sparse::wgpu…`). The attention-level WGPU tests, which compose the same kernels, run once,
# in the main pass. Cargo.lock is restored afterwards. Arguments go to the test binary (e.g.
# `--test-threads 1`).
#
# `scripts/pitched-wgpu.sh --prepare` only makes the patched copy and prints the `--config`
# value that builds against it: scripts/test.sh builds the workspace with it (without the
# variable the patched crate behaves as the released one) and passes it back in
# PITCHED_WGPU_CONFIG, so that this pass reruns the same test binary instead of building
# another.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.11.3
# Makes the patched copy of cubecl-wgpu (once per version of the patch) and prints the
# `--config` value that patches it in.
prepare() {
    local manifest target dir stamp
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
    # A fresh copy only when the patch changed: Cargo rebuilds a path dependency (and all of
    # Burn above it) when its files are newer than its last build.
    stamp=$(cksum < scripts/pitched-wgpu.patch)
    if [ ! -f "$dir.stamp" ] || [ "$(cat "$dir.stamp")" != "$stamp" ]; then
        rm -rf "$dir" "$dir.stamp"
        cp -r "$(dirname "$manifest")" "$dir"
        patch --quiet --strip 1 --directory "$dir" < scripts/pitched-wgpu.patch
        echo "$stamp" > "$dir.stamp"
    fi
    echo "patch.crates-io.cubecl-wgpu.path=\"$dir\""
}

if [ "${1:-}" = --prepare ]; then
    prepare
    exit 0
fi
# scripts/test.sh gives the value it built with (the lock file is patched by then).
config=${PITCHED_WGPU_CONFIG:-$(prepare)}

# The `[patch]` changes cubecl-wgpu's source in Cargo.lock; put the file back however this ends.
lock=$(mktemp)
cp Cargo.lock "$lock"
trap 'cp "$lock" Cargo.lock; rm -f "$lock"' EXIT

export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"
# The features of scripts/test.sh, so that its build serves here unchanged.
CUBECL_WGPU_PITCHED=1 cargo test --workspace \
    --features clustered-attention/wgpu --test suite --config "$config" \
    -- gpu::wgpu:: sparse::wgpu --skip gpu::wgpu::forwards_read_nothing_back "$@"
