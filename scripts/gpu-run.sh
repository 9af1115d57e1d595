#!/usr/bin/env bash
# Runs on a machine with an NVIDIA GPU, from a kit that scripts/gpu-bundle.sh builds (copied
# there as gpu-kit/PART/run.sh beside `bin.tar.xz`, which holds `suite` (PART tests), `bench`
# (bench) or `ddp` (ddp), and lib/, the shared libraries they need): the
# CUDA tests (`suite`, built with clustered-attention's `cmma` feature, so the tests of the
# scores on tensor cores, `cuda::cmma_*`, among them), a check of training with DDP
# (ddp-test.log), then the CUDA benchmark (forward and train, 4 and 8 heads, L up
# to 65536, Burn's fused attention beside ours; then clustered and improved in f32, bf16 and f16
# at L = 16384 and 65536; then again in bf16 and f16 at 8 heads, the tables of the scores on
# tensor cores), and last one training step of a whole encoder, burn-nn's beside ours (device
# memory and step time). `bench` is built with `cmma` too: where the GPU reports a tile shape for f16
# or bf16, the half-precision tests and tables run the scores on cooperative matrices (each
# table says which products ran). A kit without one of the programs skips what needs it.
#
# Use: bash gpu-kit/PART/run.sh [RESULTS_DIR]   (default: $OUT, else gpu-results)
# Writes to RESULTS_DIR: summary.md (device, each test's outcome, the benchmark tables, ours
# over PyTorch's SDPA timed on the same shapes by sdpa-bench.py),
# tests.log, bench.log, results.tar.gz (every table as markdown, CSV, JSON and SVG) and, for tests
# that faulted, sanitizer/. Until the run completes, the tests' logs are in
# RESULTS_DIR/cuda-tests/ and the tables in RESULTS_DIR/cuda-tables/.
#
# Each CUDA test runs in a process of its own: a kernel that faults leaves the CUDA context
# unusable, and in one process every later test would fail with it. Time caps, in seconds:
# TEST_TIMEOUT_S per test (default 300, as a test compiles the kernels it is the first to use),
# TEST_JOBS tests at once (default 4), BENCH_TIMEOUT_S per benchmark table (default 900).
# BENCH_LENGTHS (default 1024,4096,16384,65536) shortens the 4- and 8-head tables, BENCH_RUNS
# (default 5) sets the runs of every table and BENCH_MIN_TIME_S (default 0: exactly BENCH_RUNS)
# the bench's --min-time-s. Tests that stop on a memory fault, and those named in SANITIZE_ALSO,
# run again under compute-sanitizer (SANITIZE_TESTS, SANITIZE_TOOLS, SANITIZE_TIMEOUT_S; reports
# in RESULTS_DIR/sanitizer/).
# TESTS (comma separated exact names, or none; default all) picks the CUDA tests.
# BENCH_TABLES (comma separated, default all) picks tables by name: encoder, forward-h4, forward-h8,
# train-h4, train-h8, launches-forward, launches-train, then forward-f32, forward-bf16,
# forward-f16, train-f32, train-bf16, train-f16, then cmma-forward-bf16, cmma-train-bf16,
# cmma-forward-f16 (all on Burn's fused Cuda). RUN_DEADLINE_S (default none), seconds: each test,
# sanitizer run and table gets at most what is left of it, less 20 s for the results, and is
# skipped (said so in summary.md) when under 30 s would be left; the run then ends within about
# RUN_DEADLINE_S.
set -uo pipefail
if [ -n "${RUN_DEADLINE_S:-}" ] && ! [[ $RUN_DEADLINE_S =~ ^[0-9]+$ ]]; then
    echo "RUN_DEADLINE_S must be a number of seconds, got '$RUN_DEADLINE_S'" >&2
    exit 2
fi
# `bash gpu-kit/PART/run.sh --check-setup`: only the set-up (libraries, NVRTC, CUDA_PATH and a probe
# compile with the headers), reported on standard output, without running anything on the GPU.
check_setup=0
if [ "${1:-}" = --check-setup ]; then
    check_setup=1
    shift
fi
sanitize_also=${SANITIZE_ALSO:-}
sanitize_tools=${SANITIZE_TOOLS:-memcheck}
for tool in ${sanitize_tools//,/ }; do
    case $tool in
    memcheck | initcheck | racecheck | synccheck) ;;
    *)
        echo "SANITIZE_TOOLS: unknown tool $tool (memcheck, initcheck, racecheck, synccheck)" >&2
        exit 2
        ;;
    esac
done
kit=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${1:-${OUT:-gpu-results}}" && cd "${1:-${OUT:-gpu-results}}" && pwd)
[ -n "$out" ] || { echo "cannot use the results folder ${1:-${OUT:-gpu-results}}" >&2; exit 2; }
work=$(mktemp -d)
bin=$(mktemp -d)
# The binaries and lib/ from bin.tar.xz (xz, or Python's lzma where xz is missing).
# unpack ARCHIVE DIR: the .tar.xz ARCHIVE into DIR (xz, or Python's lzma where xz is missing).
unpack() {
    if command -v xz >/dev/null; then
        xz -dc "$1" | tar -xf - -C "$2"
    else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
            "$1" "$2"
    fi || { echo "cannot unpack $1" >&2; exit 1; }
}
if [ -f "$kit/bin.tar.xz" ]; then
    unpack "$kit/bin.tar.xz" "$bin"
elif [ "$check_setup" = 0 ]; then
    echo "the kit has no bin.tar.xz" >&2
    exit 1
fi
# has NAME: whether the kit holds the program NAME.
has() { [ -x "$bin/$1" ]; }
has suite || has bench || has ddp || [ "$check_setup" = 1 ] ||
    { echo "the kit holds no program" >&2; exit 1; }

# The shared libraries of lib/ (the C++ runtime, and what Debian's LLVM named at the build):
# those the machine has are set aside, and used after all when a program would then miss a
# library or a version of one (an older C++ runtime); what is left goes on LD_LIBRARY_PATH.
kit_libs="none"
if [ -d "$bin/lib" ]; then
    mkdir -p "$bin/lib-spare"
    for lib in "$bin"/lib/*; do
        [ -e "$lib" ] || continue
        if ldconfig -p | grep -q "^[[:space:]]*$(basename "$lib") "; then
            mv "$lib" "$bin/lib-spare/"
        fi
    done
    for name in suite bench ddp; do
        has "$name" || continue
        if LD_LIBRARY_PATH="$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$bin/$name" 2>&1 |
            grep -q 'not found'; then
            mv "$bin"/lib-spare/* "$bin/lib/" 2>/dev/null
            break
        fi
    done
    if [ -n "$(ls "$bin/lib")" ]; then
        kit_libs=$(ls "$bin/lib" | paste -sd ' ')
        export LD_LIBRARY_PATH="$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi

# Kernels are compiled at run time by NVRTC: find it in the CUDA toolkit or in python3's NVIDIA
# wheels (`nvidia-cuda-nvrtc`, which PyTorch installs).
site_packages=()
if command -v python3 >/dev/null; then
    mapfile -t site_packages < <(python3 -c 'import site
for path in site.getsitepackages() + [site.getusersitepackages()]: print(path)' 2>/dev/null)
fi
nvrtc=$(ldconfig -p | awk '/libnvrtc\.so/ { print $NF; exit }')
if [ -z "$nvrtc" ]; then
    nvrtc=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets /usr/lib /opt /usr/local/lib \
        "${site_packages[@]/%//nvidia}" -name 'libnvrtc.so*' ! -name '*builtins*' \
        ! -name '*.alt.*' 2>/dev/null | sort | head -1)
    if [ -n "$nvrtc" ]; then
        export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi

# NVRTC compiles the kernels' CUDA C++, which includes the CUDA headers (cuda_fp16.h,
# cuda_bf16.h, mma.h): cubecl-cuda 0.11.3 looks for them under $CUDA_PATH/include (and
# include/cccl), and panics with "CUDA installation not found" at the first kernel unless
# CUDA_PATH is set or /usr/local/cuda, /opt/cuda or /usr/bin/nvcc exists. CUDA_PATH is the first
# of: CUDA_PATH as given, /usr/local/cuda, /opt/cuda (the toolkit's), python3's NVIDIA wheels
# (nvidia/cu13 or nvidia/cuda_runtime, with their include/), and the kit's own headers
# (cuda-headers.tar.xz: the PyPI wheels of scripts/cuda-offline-requirements.txt, CUDA 13.0),
# each only where include/cuda_fp16.h is.
cuda_path_from=
for candidate in "${CUDA_PATH:-}" /usr/local/cuda /opt/cuda \
    "${site_packages[@]/%//nvidia/cu13}" "${site_packages[@]/%//nvidia/cuda_runtime}" kit; do
    [ -n "$candidate" ] || continue
    if [ "$candidate" = kit ]; then
        [ -f "$kit/cuda-headers.tar.xz" ] || continue
        mkdir -p "$work/cuda"
        unpack "$kit/cuda-headers.tar.xz" "$work/cuda"
        candidate="$work/cuda"
    fi
    if [ -f "$candidate/include/cuda_fp16.h" ]; then
        [ "$candidate" = "$work/cuda" ] && cuda_path_from="the kit's headers" ||
            cuda_path_from="$candidate"
        export CUDA_PATH="$candidate"
        break
    fi
done
# What the set-up found, and the probe: NVRTC compiles a kernel that includes the headers the
# crate's kernels include, for sm_80, as cubecl-cuda would call it. Returns 1 when NVRTC or
# the headers are missing, 2 when the probe failed.
setup_report() {
    echo "NVRTC: ${nvrtc:-NOT FOUND (install the CUDA toolkit or the nvidia-cuda-nvrtc wheel)}"
    if [ -n "$cuda_path_from" ]; then
        echo "CUDA_PATH: $CUDA_PATH (from $cuda_path_from)"
    else
        echo "CUDA_PATH: NOT FOUND: no include/cuda_fp16.h in CUDA_PATH (${CUDA_PATH:-unset})," \
            "/usr/local/cuda, /opt/cuda, python3's NVIDIA wheels or the kit (no cuda-headers.tar.xz)"
    fi
    if [ -z "$nvrtc" ] || [ -z "$cuda_path_from" ]; then
        return 1
    fi
    if ! command -v python3 >/dev/null; then
        echo "probe: not run (no python3)"
        return 0
    fi
    python3 "$kit/cuda_offline.py" --probe "$nvrtc" "$CUDA_PATH" || return 2
}
if [ "$check_setup" = 1 ]; then
    setup_report
    status=$?
    driver=$(ldconfig -p | awk '/libcuda\.so\.1/ { print $NF; exit }')
    echo "driver (libcuda.so.1), needed next: ${driver:-not found}"
    exit $status
fi
setup_report >"$work/setup.log" 2>&1
case $? in
1)
    cat "$work/setup.log" >&2
    echo "the CUDA kernels cannot be compiled here: see above" >&2
    exit 1
    ;;
2)
    # The probe is this script's own call of NVRTC: the tests still run, and say more.
    cat "$work/setup.log" >&2
    echo "warning: the NVRTC probe failed (above); running the tests anyway" >&2
    ;;
esac

{
    echo "# CUDA run"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    echo '```'
    echo
    echo "Kit: $(for name in suite bench ddp; do has "$name" && echo "$name"; done | paste -sd ' ')" \
        "(libraries from the kit: $kit_libs)"
    echo
    echo '```'
    cat "$work/setup.log"
    echo '```'
} >"$out/summary.md"

# within_deadline LIMIT: LIMIT, or less to end within RUN_DEADLINE_S (20 s kept for the
# results); nothing, and status 1, when under 30 s would be left.
within_deadline() {
    local limit=$1
    if [ -n "${RUN_DEADLINE_S:-}" ]; then
        local left=$((RUN_DEADLINE_S - SECONDS - 20))
        [ "$left" -ge 30 ] || return 1
        [ "$left" -ge "$limit" ] || limit=$left
    fi
    echo "$limit"
}

# Every CUDA test of the suite (they are #[ignore]d where no GPU is), each in its own process.
# The tests' logs and the tables go to RESULTS_DIR as they are written, so that a run cut short
# still leaves what it did; once complete they are gathered into tests.log and results.tar.gz.
tests="$out/cuda-tests"
tables="$out/cuda-tables"
rm -rf "$tests" "$tables" "$out/sanitizer"
mkdir -p "$tests" "$tables"
: >"$work/test-list"
if has suite; then
    "$bin/suite" --ignored --list cuda 2>/dev/null | sed -n 's/: test$//p' >"$work/test-list"
    [ -s "$work/test-list" ] || { echo "no CUDA tests listed by the suite" >&2; exit 1; }
fi
cp "$work/test-list" "$work/all-tests"
# warn_unknown VARIABLE NAMES: says which of NAMES (comma separated) the suite has no CUDA test of.
warn_unknown() {
    for name in ${2//,/ }; do
        [ "$name" = none ] || grep -qxF "$name" "$work/all-tests" ||
            echo "$1: no CUDA test named $name" >&2
    done
}
# TESTS (comma separated exact names, or `none`; default all) picks the tests to run.
if [ -n "${TESTS:-}" ]; then
    warn_unknown TESTS "$TESTS"
    grep -xF -f <(tr ',' '\n' <<<"$TESTS") "$work/all-tests" >"$work/test-list"
fi
run_test() {
    local limit
    if ! limit=$(within_deadline "${TEST_TIMEOUT_S:-300}"); then
        echo "skipped: RUN_DEADLINE_S reached" >"$tests/$1.log"
        return
    fi
    # The tests check values, not speed: Burn's matmul needs no autotuning for them.
    CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}" \
        timeout -k 10 "$limit" "$bin/suite" --ignored --exact "$1" \
        --test-threads=1 >"$tests/$1.log" 2>&1
    echo "exit status $?" >>"$tests/$1.log"
}
while read -r name; do
    while [ "$(jobs -rp | wc -l)" -ge "${TEST_JOBS:-4}" ]; do wait -n; done
    run_test "$name" &
done <"$work/test-list"
wait
# passed LOG: whether the test whose log is LOG passed.
passed() { grep -q '^test result: ok. 1 passed' "$1"; }
tests_failed=0
tests_skipped=0
has suite && {
    echo
    echo "## CUDA tests, one process each"
    echo
    echo '```'
    while read -r name; do
        log="$tests/$name.log"
        if passed "$log"; then
            echo "ok      $name"
        elif grep -q '^skipped: RUN_DEADLINE_S' "$log"; then
            tests_skipped=$((tests_skipped + 1))
            echo "SKIPPED $name (RUN_DEADLINE_S reached)"
        else
            tests_failed=$((tests_failed + 1))
            echo "FAILED  $name ($(tail -1 "$log"); 124 = over its time limit)"
            grep -m1 -A2 'panicked at' "$log" | sed 's/^/        /' | cut -c1-300
        fi
    done <"$work/test-list"
    echo "$tests_failed of $(wc -l <"$work/test-list") failed, $tests_skipped skipped"
    echo '```'
} >>"$out/summary.md"
while read -r name; do
    echo "===== $name"
    cat "$tests/$name.log"
done <"$work/test-list" >"$out/tests.log"

# A test that stopped on a memory fault runs again under compute-sanitizer, which names the
# kernel, the thread and the address: the first SANITIZE_TESTS of them (default 2), and the
# tests named in SANITIZE_ALSO (comma separated, exact names, whatever their outcome: a wrong
# value may come from a read of memory no kernel wrote), SANITIZE_TIMEOUT_S each (default 240),
# with each tool of SANITIZE_TOOLS (comma separated: memcheck, initcheck, racecheck, synccheck;
# default memcheck), when the sanitizer is installed.
sanitizer=$(command -v compute-sanitizer ||
    find /usr/local/cuda*/bin /opt -name compute-sanitizer -type f 2>/dev/null | head -1)
faulted=$(while read -r name; do
    log="$tests/$name.log"
    ! passed "$log" &&
        grep -qE 'CUDA_ERROR_(ILLEGAL_ADDRESS|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS|LAUNCH_FAILED)' \
            "$log" && echo "$name"
done <"$work/test-list" | head -n "${SANITIZE_TESTS:-2}")
# SANITIZE_ALSO's tests run under the sanitizer even when TESTS leaves them out.
warn_unknown SANITIZE_ALSO "$sanitize_also"
for name in ${sanitize_also//,/ }; do
    if grep -qxF "$name" "$work/all-tests" && ! grep -qxF "$name" <<<"$faulted"; then
        faulted+=$'\n'"$name"
    fi
done
faulted=$(sed '/^$/d' <<<"$faulted")
if [ -n "$faulted" ]; then
    {
        echo
        echo "## Tests under compute-sanitizer ($sanitize_tools)"
        echo
        echo '```'
        if [ -z "$sanitizer" ]; then
            echo "compute-sanitizer not found (PATH, /usr/local/cuda*/bin, /opt)"
        fi
    } >>"$out/summary.md"
    if [ -n "$sanitizer" ]; then
        mkdir -p "$out/sanitizer"
        # The tools' error lines, where the error happened, and their count of errors.
        headlines='^=+ (Invalid|Illegal|Misaligned|Out-of-range|Uninitialized|Race|Barrier|Warp|'
        headlines+='Program hit|ERROR SUMMARY|RACECHECK SUMMARY)|^=+ +(at |by thread|Address)'
        for name in $faulted; do
            for tool in ${sanitize_tools//,/ }; do
                log="$out/sanitizer/$name.$tool.log"
                if ! limit=$(within_deadline "${SANITIZE_TIMEOUT_S:-240}"); then
                    echo "$name, $tool (skipped: RUN_DEADLINE_S reached)" >>"$out/summary.md"
                    continue
                fi
                CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}" \
                    timeout -k 10 "$limit" "$sanitizer" --tool "$tool" \
                    --print-limit 20 "$bin/suite" --ignored --exact "$name" \
                    --test-threads=1 \
                    >"$log" 2>&1
                echo "exit status $?" >>"$log"
                {
                    echo "$name, $tool ($(tail -1 "$log"); 124 = over its time limit)"
                    grep -E "$headlines" "$log" |
                        head -12 | sed 's/^/    /' | cut -c1-300
                } >>"$out/summary.md"
            done
        done
    fi
    echo '```' >>"$out/summary.md"
fi

# Training with burn-train's DDP on the first GPU (DDP=0 skips it): the `ddp` test (DDP
# against one device, to 1e-5), DDP_TIMEOUT_S (default 240).
# cudarc loads NCCL as `libnccl.so`; NCCL's own packages and PyTorch's wheel have
# `libnccl.so.2`: a link to it is made when the loader finds no `libnccl.so`.
if [ "${DDP:-1}" != 0 ] && [ -x "$bin/ddp" ]; then
    nccl_note="libnccl.so in the loader's cache"
    if ! ldconfig -p | grep -q 'libnccl\.so '; then
        nccl_note="no libnccl.so found"
        nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
        [ -f "$nccl" ] || nccl=$(find /usr/lib /usr/local /opt -name 'libnccl.so*' 2>/dev/null | head -1)
        if [ -n "$nccl" ] && [ -f "$nccl" ]; then
            mkdir -p "$work/nccl" && ln -sf "$nccl" "$work/nccl/libnccl.so"
            export LD_LIBRARY_PATH="$work/nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            nccl_note="libnccl.so linked to $nccl"
        fi
    fi
    {
        echo
        echo "## Training with DDP on CUDA"
        echo
        echo '```'
        echo "NCCL: $nccl_note"
    } >>"$out/summary.md"
    if limit=$(within_deadline "${DDP_TIMEOUT_S:-240}"); then
        CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}" \
            timeout -k 10 "$limit" "$bin/ddp" --test-threads=1 --nocapture >"$out/ddp-test.log" 2>&1
        echo "ddp test: exit status $?" >>"$out/summary.md"
        grep -E '^ddp on|^test result|panicked at' -A1 "$out/ddp-test.log" | cut -c1-300 >>"$out/summary.md"
    else
        echo "ddp test skipped: RUN_DEADLINE_S reached" >>"$out/summary.md"
    fi
    echo '```' >>"$out/summary.md"
fi

# PyTorch's scaled_dot_product_attention on the benchmark's shapes (flash for bf16/f16,
# memory-efficient for f32): what a user would pick instead. The machine's python3 needs torch;
# without it the ratios are left out. Ours over SDPA ends summary.md. SDPA_HEADS (default 4,8)
# and SDPA_DTYPES (default f32,bf16,f16) narrow it to the tables picked.
sdpa_csv="$work/sdpa.csv"
: >"$sdpa_csv"
if has bench && limit=$(within_deadline "${SDPA_TIMEOUT_S:-150}"); then
    timeout -k 10 "$limit" python3 "$kit/sdpa-bench.py" --heads "${SDPA_HEADS:-4,8}" \
        --lengths "${BENCH_LENGTHS:-1024,4096,16384,65536}" --dtypes "${SDPA_DTYPES:-f32,bf16,f16}" \
        --runs "${BENCH_RUNS:-5}" >"$sdpa_csv" 2>"$out/sdpa.log" ||
        echo "sdpa-bench stopped (exit status $?), see sdpa.log" >>"$out/sdpa.log"
fi

bench_status=0
: >"$out/bench.log"
# bench_table NAME TITLE ARGS...: one benchmark run, its table appended to summary.md.
bench_table() {
    local name=$1 title=$2 limit
    shift 2
    if ! has bench || { [ -n "${BENCH_TABLES:-}" ] &&
        [[ ",${BENCH_TABLES// /}," != *",${name#cuda-},"* ]]; }; then
        return
    fi
    if ! limit=$(within_deadline "${table_timeout:-${BENCH_TIMEOUT_S:-900}}"); then
        printf '\n## %s (skipped: RUN_DEADLINE_S reached)\n' "$title" >>"$out/summary.md"
        return
    fi
    timeout -k 10 "$limit" "$bin/bench" --runs "${BENCH_RUNS:-5}" \
        --min-time-s "${BENCH_MIN_TIME_S:-0}" --memory-gib 70 --out-dir "$tables" --name "$name" "$@" 2>&1 | tee -a "$out/bench.log"
    local status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || bench_status=$status
    {
        echo
        echo "## $title (exit status $status; 124 = over its time limit, $limit s)"
        echo
        cat "$tables/$name.md" 2>/dev/null
    } >>"$out/summary.md"
}
# BENCH_ONLY (comma separated, default all) narrows these four tables to some attentions.
for mode in forward train; do
    for heads in 4 8; do
        bench_table "cuda-$mode-h$heads" "$mode, $heads heads" --backends cuda --mode "$mode" \
            --heads "$heads" --lengths "${BENCH_LENGTHS:-1024,4096,16384,65536}" \
            ${BENCH_ONLY:+--only "$BENCH_ONLY"}
    done
done
# The kernel launches of each attention in a table of their own (the counting logs one line
# per launch during its timed runs too, so these times are not the tables' above).
for mode in forward train; do
    bench_table "cuda-launches-$mode" "kernel launches, $mode, 8 heads, L = 16384" \
        --backends cuda --mode "$mode" --heads 8 --lengths 16384 --count-launches
done
# f32 against bf16 and f16 for the clustered attentions, at the lengths they are for, each table
# a process of its own, so that a fault in one leaves the others.
for mode in forward train; do
    for dtype in f32 bf16 f16; do
        bench_table "cuda-$mode-$dtype" "cuda, $mode, $dtype, 4 heads" \
            --backends cuda --mode "$mode" --dtype "$dtype" --heads 4 \
            --lengths 16384,65536 --only clustered,improved
    done
done
# The scores on tensor cores (clustered-attention's `cmma` feature, on in the kit's bench) at 8
# heads, as the SDPA comparison above; the tables say which products ran.
for table in forward-bf16 train-bf16 forward-f16; do
    bench_table "cuda-cmma-$table" \
        "cuda with cmma, ${table%-*}, ${table#*-}, 8 heads" --backends cuda \
        --mode "${table%-*}" --dtype "${table#*-}" --heads 8 --lengths 16384,65536 \
        --only clustered,improved
done
# One training step of a whole encoder (forward, backward, Adam): burn-nn's TransformerEncoder
# beside this crate's with full, clustered and improved attention, 4 layers, d_model 256, 8
# heads, each in a process of its own; the device memory its pools held, and "over the device's
# memory" where an allocation failed. ENCODER_LENGTHS (default 1024,4096,16384,65536),
# ENCODER_TIMEOUT_S (default BENCH_TIMEOUT_S), ENCODER_AUTOTUNE_LEVEL (default minimal: each
# child would tune Burn's matmuls for its shapes again, the same for every encoder).
table_timeout=${ENCODER_TIMEOUT_S:-} \
    CUBECL_AUTOTUNE_LEVEL=${ENCODER_AUTOTUNE_LEVEL:-minimal} bench_table cuda-encoder \
    "encoder training step, 4 layers, d_model 256, 8 heads" --backends cuda --mode encoder \
    --lengths "${ENCODER_LENGTHS:-1024,4096,16384,65536}"
if [ "$(wc -l <"$sdpa_csv")" -gt 1 ]; then
    {
        echo
        echo "## Ours over PyTorch's SDPA, same shapes, same call (below 1: faster)"
        echo
        python3 "$kit/sdpa-bench.py" --ratios "$sdpa_csv" "$tables"/*.csv
    } >>"$out/summary.md" 2>&1
    cp "$sdpa_csv" "$tables/sdpa.csv"
fi
tar czf "$out/results.tar.gz" -C "$tables" .
rm -rf "$work" "$bin" "$tests" "$tables"
echo "results in $out: summary.md, tests.log, bench.log, results.tar.gz (and sanitizer/ for faults)"
[ "$tests_failed" -eq 0 ] && [ "$tests_skipped" -eq 0 ] && [ "$bench_status" -eq 0 ]
