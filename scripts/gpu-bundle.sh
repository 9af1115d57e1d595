#!/usr/bin/env bash
# Builds the CUDA kit on a machine without a GPU: stripped, xz-compressed release binaries of the
# benchmark CLI (`bench`, CUDA backend only), of the test suite that holds the CUDA tests
# (`suite`), of both again with clustered-attention's `cmma` feature (`bench-cmma`,
# `suite-cmma`: the scores on tensor cores in f16 and bf16), and of `asr` and its `ddp` test
# (asr-model's `ddp` feature), `run.sh`, the one command to run on the GPU machine, and
# `sdpa-bench.py`, which times PyTorch's attention on the same shapes there. Everything lands
# in `gpu-kit/` (git-ignored), under 64 MiB.
#
# Use: `bash scripts/gpu-bundle.sh`, copy `gpu-kit/` to a Linux x86-64 machine with an NVIDIA
# GPU (driver for CUDA 13; NVRTC from the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel), and
# run `bash gpu-kit/run.sh RESULTS_DIR` there (RESULTS_DIR defaults to `$OUT`, else
# `gpu-results`). CUDA is loaded at run time, so no toolkit is needed to build.
set -euo pipefail
cd "$(dirname "$0")/.."

# cudarc's bindings: CUDA 13.0, the version of the drivers this kit is meant for.
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
kit=gpu-kit
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

# test_binary NAME CARGO_TEST_ARGS...: builds a test binary and prints the path of the one
# whose target is NAME.
test_binary() {
    local name=$1
    shift
    cargo test "$@" --no-run --message-format=json | NAME="$name" python3 -c '
import json, os, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") \
            and message["target"]["name"] == os.environ["NAME"]:
        print(message["executable"])
'
}

# The binaries are gathered here as they are built (`bench` and `bench-cmma` share a path).
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
cargo build --release --locked -p bench --no-default-features --features cuda
cp "$target/release/bench" "$staging/bench"
cargo build --release --locked -p bench --no-default-features --features cuda,cmma
cp "$target/release/bench" "$staging/bench-cmma"
# The test binary that holds the CUDA tests (the `suite` integration test). Without Burn's
# autotuning: the tests check values, and with it the half-precision tests ran past 150 s on an
# H100, where a build without it had taken ~35 s. The benchmark keeps it.
suite=$(test_binary suite --release --locked -p clustered-attention --features cuda --test suite)
cp "$suite" "$staging/suite"
suite=$(test_binary suite --release --locked -p clustered-attention --features cuda,cmma \
    --test suite)
cp "$suite" "$staging/suite-cmma"

# Training on CUDA with burn-train's DDP: `asr` and the `ddp` test, built with asr-model's
# `ddp` feature (CUDA alone: with Burn's `distributed`, the CPU backends cannot train).
cargo build --release --locked -p asr-model --no-default-features --features ddp --bin asr
ddp=$(test_binary ddp --release --locked -p asr-model --no-default-features --features ddp \
    --test ddp)
cp "$target/release/asr" "$staging/asr"
cp "$ddp" "$staging/ddp"

binaries=(bench bench-cmma suite suite-cmma asr ddp)
rm -rf "$kit"
mkdir -p "$kit"
for name in "${binaries[@]}"; do
    cp "$staging/$name" "$kit/$name"
    strip "$kit/$name"
    # xz brings them to about a sixth, a third less than gzip -9 (run.sh unpacks them).
    xz -9 -T2 "$kit/$name"
done
cp scripts/gpu-run.sh "$kit/run.sh"
cp scripts/sdpa-bench.py "$kit/sdpa-bench.py"

size=$(du -cb "$kit" | tail -1 | cut -f1)
if [ "$size" -gt $((64 * 1024 * 1024)) ]; then
    echo "gpu-kit is $((size / 1024 / 1024)) MiB, over 64 MiB" >&2
    exit 1
fi
ls -l "$kit"
echo "gpu-kit: $((size / 1024 / 1024)) MiB; on the GPU machine: bash gpu-kit/run.sh RESULTS_DIR"
