#!/usr/bin/env bash
# Builds the CUDA kits on a machine without a GPU: stripped release binaries of the test suite
# that holds the CUDA tests (`suite`), of the benchmark CLI (`bench`, CUDA backend only), both
# with clustered-attention's `cmma` feature, and of asr-model's `ddp` test (its `ddp` feature),
# one kit per part in `gpu-kit/PART/` (git-ignored): its binaries packed in one xz
# archive (`bin.tar.xz`), `run.sh`, the one command to run on the GPU machine, `sdpa-bench.py`,
# which times PyTorch's attention on the same shapes there, and the CUDA headers. A device call
# carries one kit with the working tree, 64 MiB in all: the script fails, saying so, when a kit
# and the tree are over. (With the tree at 30 MiB, the three parts in one kit were 52.8 MiB.)
#
# Use: `bash scripts/gpu-bundle.sh [PART...]`, copy `gpu-kit/PART/` to a Linux x86-64 machine
# with an NVIDIA GPU (driver for CUDA 13; NVRTC from the CUDA toolkit or the `nvidia-cuda-nvrtc`
# wheel; the CUDA headers from the toolkit, the wheels, or the kit's own `cuda-headers.tar.xz`),
# and run `bash gpu-kit/PART/run.sh RESULTS_DIR` there (RESULTS_DIR defaults to `$OUT`, else
# `gpu-results`); run.sh runs what its kit holds. PARTs (default all three): `tests` (`suite`:
# the CUDA tests), `bench` (`bench`: the benchmark tables and the comparison with PyTorch's
# SDPA), `ddp` (`ddp`: training with DDP against one device; `asr` itself, 155 MiB stripped,
# would take the kit over the limit). CUDA is loaded at run time, so no toolkit
# is needed to build.
#
# Why so few binaries: on Burn 0.22 every CUDA binary links LLVM statically (burn-cuda →
# cubecl-cuda → cubecl-llvm; scripts/offline-llvm.sh sets up Debian's, run first here), so each
# is over 120 MB stripped (about 24.5 MB with `xz -9` alone). Two builds make the three: the
# suite without Burn's autotuning, the two others with it, in one cargo invocation. With
# `cmma` on, the CUDA tests of the scores on cooperative matrices are in the same
# suite as the others, and the bench's f16 and bf16 tables say which products ran. (The
# scores take cooperative matrices wherever the device reports a tile shape for f16 or bf16
# into f32, as a tensor-core GPU does: there the half-precision tests and tables run them, and
# the multiply-add path runs in f32 and on devices without tile shapes.)
set -euo pipefail
cd "$(dirname "$0")/.."

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests bench ddp)
for part in "${parts[@]}"; do
    case $part in
    tests | bench | ddp) ;;
    *)
        echo "gpu-bundle: unknown part $part (tests, bench, ddp)" >&2
        exit 2
        ;;
    esac
done
# has PART: whether PART is to be built.
has() { [[ " ${parts[*]} " == *" $1 "* ]]; }

# cudarc's bindings: CUDA 13.0, the version of the drivers this kit is meant for.
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
kit=gpu-kit
# A device call carries the working tree with the kit: 64 MiB in all, the tracked and the
# untracked files that git does not ignore included (the checkout's data/ alone is about
# 28 MiB). What is left of it is the kit's limit.
# (A tracked file deleted from the tree is not counted: `stat` fails on it.)
tree=$(git ls-files -z --cached --others --exclude-standard |
    { xargs -0 stat -c %s 2>/dev/null || true; } | awk '{ sum += $1 } END { print sum + 0 }')
limit=$((64 * 1024 * 1024 - tree))

# The LLVM that the CUDA backend links, from Debian's packages (no download from GitHub).
bash scripts/offline-llvm.sh

# executables CARGO_ARGS...: runs `cargo CARGO_ARGS --message-format=json` and prints, for each
# executable it built, its target's name and its path, one line each.
executables() {
    cargo "$@" --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["target"]["name"], message["executable"])
'
}
# path_of NAME: the first path that the list on standard input (from `executables`) gives NAME;
# fails, saying so, when it has none.
path_of() {
    awk -v name="$1" '!found && $1 == name { print $2; found = 1 } END { exit !found }' ||
        { echo "gpu-bundle: the build made no executable named $1" >&2; return 1; }
}

# The binaries are gathered here, stripped, as they are built.
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
binaries=()
# add NAME: NAME in the kit is the executable named NAME in $built (the list of `executables`).
add() {
    local path
    path=$(path_of "$1" <<<"$built")
    cp "$path" "$staging/$1"
    strip "$staging/$1"
    binaries+=("$1")
}
if has tests; then
    # The test binary that holds the CUDA tests (the `suite` integration test), the tests of
    # the scores on cooperative matrices (`cuda::cmma_*`) among them. Without Burn's
    # autotuning: the tests check values, and with it the half-precision tests ran past 150 s
    # on an H100, where a build without it had taken ~35 s. The benchmark keeps it.
    built=$(executables test --release --locked -p clustered-attention --features cuda,cmma \
        --test suite --no-run)
    add suite
fi
if has bench || has ddp; then
    # `bench` (CUDA backend only), and asr-model's `ddp` test (its `ddp` feature,
    # training on CUDA with burn-train's DDP; CUDA alone: with Burn's `distributed`, the CPU
    # backends cannot train), in one build: both take Burn's autotuning, so one build of the
    # Burn stack serves both (the features of one cargo invocation are unified: asr-model gets
    # `cmma` too, which changes nothing in f32).
    packages=()
    features=()
    if has bench; then
        packages+=(-p bench --bin bench)
        features+=(bench/cuda bench/cmma)
    fi
    if has ddp; then
        packages+=(-p asr-model --test ddp)
        features+=(asr-model/ddp)
    fi
    built=$(executables build --release --locked --no-default-features "${packages[@]}" \
        --features "$(IFS=,; echo "${features[*]}")")
    if has bench; then
        add bench
    fi
    if has ddp; then
        add ddp
    fi
fi

# mib FILE: the size of FILE in MiB, one decimal.
mib() { awk -v bytes="$(stat -c %s "$1")" 'BEGIN { printf "%.1f", bytes / 1048576 }'; }
echo "gpu-kit binaries (stripped):"
for name in "${binaries[@]}"; do
    printf '  %-24s %6s MiB  needs %s\n' "$name" "$(mib "$staging/$name")" \
        "$(readelf -d "$staging/$name" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | paste -sd ' ')"
done

# The CUDA headers that the kernels' sources include (cuda_fp16.h, cuda_bf16.h, mma.h and what
# they include), from the pinned PyPI wheels of scripts/cuda-offline.sh: run.sh points
# CUDA_PATH at them on a machine that has NVRTC but no CUDA toolkit.
cuda_tree=$(bash scripts/cuda-offline.sh --tree)
tar -C "$cuda_tree" -cf - include | xz -9 -T1 >"$staging/cuda-headers.tar.xz"

# One kit per part, gpu-kit/PART/, each carried by a device call of its own (the kits of the
# parts not built this time are left as they are; the files of a kit of all parts in one, as
# this script made before, are removed).
rm -f "$kit"/bin.tar.xz "$kit"/cuda-headers.tar.xz "$kit"/run.sh "$kit"/cuda_offline.py \
    "$kit"/sdpa-bench.py
over=()
for part in "${parts[@]}"; do
    case $part in
    tests) names=(suite) ;;
    bench) names=(bench) ;;
    ddp) names=(ddp) ;;
    esac
    dir="$kit/$part"
    pack="$staging/pack-$part"
    rm -rf "$dir"
    mkdir -p "$dir" "$pack/lib"
    for name in "${names[@]}"; do
        ln "$staging/$name" "$pack/$name"
    done
    # The shared libraries the binaries need beyond glibc's and libgcc's (the C++ runtime and
    # whatever Debian's LLVM names, e.g. libz3, libxml2, libzstd, with what they need in turn)
    # go in the kit's lib/: run.sh uses those the GPU machine lacks or has too old.
    base='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|librt|libpthread|libutil|libresolv|libgcc_s)\.so'
    for name in "${names[@]}"; do
        ldd "$pack/$name" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
    done | sort -u | while read -r soname path; do
        [[ $soname =~ $base ]] || cp -L "$path" "$pack/lib/$soname"
    done
    libs=$(cd "$pack/lib" && ls)
    # One xz stream over the part's binaries and lib/ (xz -9 takes a binary to about a sixth, a
    # third less than gzip -9; run.sh unpacks it with xz or Python's lzma), its dictionary the
    # power of two at or above 1.25 times the largest binary (64 MiB at least, 1 GiB at most):
    # a binary's LLVM code is then within reach of the previous one's. Compressing needs about
    # 11 times the dictionary in memory (2.8 GiB at 256 MiB), unpacking once.
    largest=$(for name in "${names[@]}"; do stat -c %s "$pack/$name"; done | sort -n | tail -1)
    dict=$((64 * 1024 * 1024))
    while [ "$dict" -lt $((largest + largest / 4)) ] && [ "$dict" -lt $((1024 * 1024 * 1024)) ]; do
        dict=$((dict * 2))
    done
    echo "packing $part: ${names[*]}${libs:+ and lib/ ($(echo $libs))} (xz -9, dictionary $((dict / 1048576)) MiB)"
    tar -C "$pack" -cf - "${names[@]}" lib |
        xz -9 -T1 --lzma2="preset=9,dict=$dict" >"$dir/bin.tar.xz"
    rm -rf "$pack"
    cp "$staging/cuda-headers.tar.xz" "$dir/cuda-headers.tar.xz"
    cp scripts/gpu-run.sh "$dir/run.sh"
    cp scripts/cuda_offline.py "$dir/cuda_offline.py"
    cp scripts/sdpa-bench.py "$dir/sdpa-bench.py"
    for file in "$dir"/*; do
        printf '  %-28s %6s MiB\n' "$file" "$(mib "$file")"
    done
    size=$(du -cb "$dir" | tail -1 | cut -f1)
    echo "$dir: $(awk -v bytes="$size" 'BEGIN { printf "%.1f", bytes / 1048576 }') MiB," \
        "at most $((limit / 1048576)) MiB (64 MiB less the working tree's $((tree / 1048576)) MiB)"
    [ "$size" -le "$limit" ] || over+=("$part")
done
if [ ${#over[@]} -gt 0 ]; then
    echo "gpu-bundle: FAILED: the kit of ${over[*]} is over $((limit / 1048576)) MiB: with the" \
        "working tree, more than one device call carries." >&2
    exit 1
fi
echo "on the GPU machine, one call per part: bash gpu-kit/PART/run.sh RESULTS_DIR"
