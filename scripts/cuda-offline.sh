#!/usr/bin/env bash
# Compiles the CUDA source of every kernel of clustered-attention with NVRTC, on a machine
# without GPU and without the CUDA toolkit: what a CUDA GPU would do at the kernels' first
# launch, up to the driver.
#
# 1. Installs NVIDIA's NVRTC and the headers cubecl's sources include from PyPI
#    (nvidia-cuda-nvrtc, -runtime, -crt, -cccl 13.0, the CUDA of the GPU machine's driver;
#    pinned by SHA-256, about 95 MB) into "$CARGO_TARGET_DIR/cuda-offline/tree", once: its
#    nvidia/cu13/ is a CUDA_PATH as cubecl-cuda expects it (include/, include/cccl/, lib/).
# 2. Runs the test `cuda_sources_compile_for_sm_80_and_sm_90` (src/backends/cube/offline.rs)
#    with CUDA_KERNELS_DIR set: every launcher's kernels, built for an A100 and an H100 in
#    f32, f16 and bf16, scores on cooperative matrices on and off, at the cases where the
#    launchers plan differently (widths, long rows, top-k, clusters, every K-means plan),
#    compiled to CUDA C++ by cubecl-cpp and written out, one file per distinct source.
# 3. Compiles each source with NVRTC, cubecl-cuda's flags (sm_80, sm_90a) and ptxas's verbose
#    report (scripts/cuda_offline.py); fails when a source does not compile, a kernel (or a
#    function it calls, each in its own block of the report) spills registers to local memory
#    or has a stack frame over 1 KiB. `cuda_offline.py --self-test` checks that reading of
#    the report on literal logs first.
#
# The test is built with scripts/test.sh's features (and its pitched-WGPU `--config`, given in
# PITCHED_WGPU_CONFIG, so that its build serves here); it runs on WGPU (Mesa's lavapipe where
# there is no GPU). Cargo.lock is restored afterwards.
#
# Use: bash scripts/cuda-offline.sh [--table FILE] [--docs] [--from DIR]
#   --table FILE     also writes the table of every kernel (registers, spills, shared memory,
#                    occupancy on A100 and H100) to FILE
#   --docs           writes that table into docs/backends.md, between its markers
#   --from DIR       compiles the sources the test already wrote to DIR (CUDA_KERNELS_DIR),
#                    without running it (scripts/test.sh's main pass writes them)
#      bash scripts/cuda-offline.sh --tree
#   only installs the CUDA tree and prints the CUDA_PATH it makes (scripts/gpu-bundle.sh
#   carries its headers in the GPU kit).
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target/cuda-offline"
tree="$(cd "$target/cuda-offline" && pwd)/tree"
requirements=scripts/cuda-offline-requirements.txt

# The wheels, unpacked once per version of the requirements.
stamp=$(cksum < "$requirements")
if [ ! -f "$tree.stamp" ] || [ "$(cat "$tree.stamp")" != "$stamp" ]; then
    rm -rf "$tree" "$tree.stamp"
    python3 -m pip install --quiet --no-deps --require-hashes --only-binary :all: \
        --no-warn-script-location --disable-pip-version-check --target "$tree" \
        -r "$requirements" 2>&1 | grep -v "^WARNING: Running pip as the 'root' user" >&2 || true
    [ -f "$tree/nvidia/cu13/include/cuda_fp16.h" ] ||
        { echo "cuda-offline: the NVRTC and header wheels did not install into $tree" >&2; exit 1; }
    echo "$stamp" > "$tree.stamp"
fi
cuda_path="$tree/nvidia/cu13"
if [ "${1:-}" = --tree ]; then
    echo "$cuda_path"
    exit 0
fi

# The reading of ptxas's report, checked first on literal logs (no NVRTC needed): a spill or a
# stack frame in any function block of a log, a called function's or a second kernel's, fails.
python3 -B scripts/cuda_offline.py --self-test

table= docs=0 from=
while [ $# -gt 0 ]; do
    case $1 in
    --table) table=${2:?--table takes a file}; shift ;;
    --docs) docs=1 ;;
    --from) from=${2:?--from takes a folder}; shift ;;
    *) echo "unknown argument $1 (--table FILE, --docs, --from DIR, --tree)" >&2; exit 2 ;;
    esac
    shift
done
tmp_table=
if [ "$docs" = 1 ] && [ -z "$table" ]; then
    table=$(mktemp)
    tmp_table=$table
fi

if [ -n "$from" ]; then
    kernels=$from
else
    kernels=$(mktemp -d)
    lock=$(mktemp)
    cp Cargo.lock "$lock"
    trap 'cp "$lock" Cargo.lock; rm -rf "$lock" "$kernels"' EXIT
    export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
    config=()
    if [ -n "${PITCHED_WGPU_CONFIG:-}" ]; then
        config=(--config "$PITCHED_WGPU_CONFIG")
    fi
    CUDA_KERNELS_DIR="$kernels" cargo test --workspace --features clustered-attention/wgpu \
        "${config[@]}" --lib -- --exact \
        backends::cube::offline::cuda_sources_compile_for_sm_80_and_sm_90
fi
[ -f "$kernels/kernels.tsv" ] || { echo "cuda-offline: no kernels.tsv in $kernels" >&2; exit 1; }

python3 scripts/cuda_offline.py "$kernels" "$cuda_path" ${table:+--table "$table"}

if [ "$docs" = 1 ]; then
    python3 - "$table" docs/backends.md <<'PY'
import sys
table, page = sys.argv[1], sys.argv[2]
start, end = "<!-- cuda-offline table: start -->", "<!-- cuda-offline table: end -->"
text = open(page).read()
if start not in text or end not in text:
    sys.exit(f"{page} has no markers {start} … {end}")
before, rest = text.split(start, 1)
_, after = rest.split(end, 1)
open(page, "w").write(before + start + "\n\n" + open(table).read().rstrip() + "\n\n" + end + after)
PY
    [ -z "$tmp_table" ] || rm -f "$tmp_table"
    echo "cuda-offline: docs/backends.md's table written"
fi
