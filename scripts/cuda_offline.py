#!/usr/bin/env python3
"""Compiles the CUDA sources of the crate's kernels with NVRTC, as cubecl-cuda 0.11.3 does at
run time, on a machine without GPU, and reports each kernel's registers, spills, shared memory
and the occupancy they allow on an A100 (sm_80) and an H100 (sm_90a).

Use: cuda_offline.py KERNELS_DIR CUDA_PATH [--table FILE] [--jobs N]
     cuda_offline.py --probe LIBNVRTC CUDA_PATH   (whether NVRTC compiles a kernel that
                    includes the headers of CUDA_PATH; the CUDA kit's run.sh asks it)

KERNELS_DIR holds what the test `cuda_sources_compile_for_sm_80_and_sm_90` wrote with
`CUDA_KERNELS_DIR` set (kernels.tsv and the .cu files); CUDA_PATH is a CUDA tree with include/
(the headers cubecl's sources include) and lib/libnvrtc.so.* (the pinned PyPI wheels of
scripts/cuda-offline.sh). The flags are cubecl-cuda's (`compute/context.rs`, `compile_to_ptx`:
`--gpu-architecture=sm_{arch}` with an `a` from 90 on, the include paths, `-lineinfo`) plus
`--ptxas-options=-v`, which makes NVRTC compile to a cubin and report the resources of the
entry function. Exits 1 when a source does not compile, a kernel spills registers to local
memory or has a stack frame over MAX_STACK bytes.
With --table, writes the markdown table of every kernel (one per source and GPU).
"""

import argparse
import ctypes
import glob
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

# Per SM, per GPU: registers, threads, blocks, shared memory (bytes, what blocks may take
# together) and the shared memory the driver reserves per block (CUDA C++ Programming Guide,
# "Compute Capabilities", table 21; Ampere and Hopper tuning guides).
GPUS = {
    "sm_80": dict(gpu="A100", regs=65536, threads=2048, blocks=32, smem=167936, reserved=1024),
    "sm_90": dict(gpu="H100", regs=65536, threads=2048, blocks=32, smem=233472, reserved=1024),
}
# The most bytes of stack frame (local memory a thread keeps for arrays it indexes at run time)
# a kernel may have: CUDA's default per-thread stack size (`cudaLimitStackSize`, 1 KiB). A
# larger frame makes the driver grow every SM's local memory at the kernel's first launch
# (frame × resident threads: 528 MiB on an H100 at 2 KiB), and a frame that large means a
# sorted list or a tile left in local memory that belongs in registers or shared memory.
MAX_STACK = 1024
# Registers are allocated per warp in units of 256; warps per SM are 64 on both.
REG_UNIT = 256
WARP = 32

_nvrtc = None


def nvrtc(library):
    """NVRTC, loaded from the file `library` (once a process)."""
    global _nvrtc
    if _nvrtc is None:
        # NVRTC opens its builtins by name at the first compile: loaded first, from the same
        # folder, they are found without LD_LIBRARY_PATH.
        for builtins in glob.glob(os.path.join(os.path.dirname(library), "libnvrtc-builtins.so*")):
            if ".alt." not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        _nvrtc = ctypes.CDLL(library)
    return _nvrtc


def nvrtc_in(cuda_path):
    """The NVRTC library of CUDA_PATH (its lib/ or lib64/)."""
    candidates = sorted(glob.glob(os.path.join(cuda_path, "lib*", "libnvrtc.so*")))
    candidates = [c for c in candidates if "builtins" not in c and ".alt." not in c]
    if not candidates:
        sys.exit(f"no libnvrtc.so* under {cuda_path}/lib or lib64")
    return candidates[0]


def nvrtc_compile(library, source, name, arch, cuda_path, verbose):
    """Compiles the CUDA C++ `source` (bytes) for `arch` (sm_80, sm_90, ...) with cubecl-cuda
    0.11.3's flags and the headers of CUDA_PATH: (ok, NVRTC's log). With `verbose`, ptxas
    reports the resources of the entry function in the log."""
    lib = nvrtc(library)
    arch = arch + ("a" if int(arch[3:]) >= 90 else "")
    include = os.path.join(cuda_path, "include")
    options = [f"--gpu-architecture={arch}", f"--include-path={include}", "-lineinfo"]
    if os.path.isdir(os.path.join(include, "cccl")):
        options.append(f"--include-path={os.path.join(include, 'cccl')}")
    if verbose:
        options.append("--ptxas-options=-v")
    program = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(program), source, name.encode(), 0, None, None)
    if status != 0:
        return False, f"nvrtcCreateProgram failed with status {status}"
    argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    status = lib.nvrtcCompileProgram(program, len(options), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return status == 0, log.value.decode(errors="replace")


def compile_source(job):
    """NVRTC's log and status for one source: (row, ok, log)."""
    row, path, cuda_path = job
    with open(path, "rb") as f:
        source = f.read()
    ok, log = nvrtc_compile(nvrtc_in(cuda_path), source, path, row["arch"], cuda_path, True)
    return row, ok, log


# What the kernels' sources include, in a kernel: `--probe` compiles it.
PROBE = b"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
extern "C" __global__ void probe(__half* a, __nv_bfloat16 const* b) {
    a[0] = __float2half(__bfloat162float(b[0]));
}
"""


def probe(library, cuda_path):
    """Whether NVRTC (`library`) compiles a kernel with the headers of CUDA_PATH, as the
    crate's kernels include them; says so on standard output."""
    lib = nvrtc(library)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    ok, log = nvrtc_compile(library, PROBE, "probe.cu", "sm_80", cuda_path, False)
    version = f"NVRTC {major.value}.{minor.value}"
    if ok:
        print(f"probe: {version} compiled a kernel with the headers of {cuda_path}")
    else:
        print(f"probe: {version} FAILED to compile with the headers of {cuda_path}:\n{log}")
    return ok


def resources(log):
    """Registers, spill bytes (stores + loads), stack bytes and static shared memory of the
    entry function, from ptxas's verbose log."""
    used = re.search(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?", log)
    frame = re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log
    )
    if not used or not frame:
        return None
    return dict(
        registers=int(used.group(1)),
        smem_static=int(used.group(2) or 0),
        stack=int(frame.group(1)),
        spills=int(frame.group(2)) + int(frame.group(3)),
    )


def occupancy(arch, threads, registers, smem):
    """Warps resident per SM over the most it holds, and what limits them."""
    gpu = GPUS[arch]
    warps = -(-threads // WARP)
    per_warp = -(-max(registers, 1) * WARP // REG_UNIT) * REG_UNIT
    limits = {
        "blocks": gpu["blocks"],
        "threads": gpu["threads"] // (warps * WARP),
        "registers": (gpu["regs"] // per_warp) // warps,
        "shared memory": gpu["smem"] // (smem + gpu["reserved"]),
    }
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], k != "threads"))
    return blocks * warps / (gpu["threads"] // WARP), limiter


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--probe":
        sys.exit(0 if probe(sys.argv[2], sys.argv[3]) else 1)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels")
    parser.add_argument("cuda_path")
    parser.add_argument("--table")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args()
    with open(os.path.join(args.kernels, "kernels.tsv")) as f:
        header = f.readline().rstrip("\n").split("\t")
        rows = [dict(zip(header, line.rstrip("\n").split("\t"))) for line in f if line.strip()]
    jobs = [(row, os.path.join(args.kernels, row["file"]), args.cuda_path) for row in rows]
    failures, results = [], []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row, ok, log in pool.map(compile_source, jobs):
            found = resources(log) if ok else None
            if not ok:
                failures.append(f"{row['file']} ({row['configs']}): does not compile\n{log}")
            elif found is None:
                failures.append(f"{row['file']}: no resource usage in NVRTC's log\n{log}")
            elif found["spills"] > 0:
                failures.append(
                    f"{row['file']} ({row['configs']}): spills {found['spills']} B "
                    f"({found['registers']} registers)\n{log}"
                )
            elif found["stack"] > MAX_STACK:
                failures.append(
                    f"{row['file']} ({row['configs']}): a stack frame of {found['stack']} B, "
                    f"over {MAX_STACK} B\n{log}"
                )
            if found:
                results.append((row, found))
    by_arch = {}
    for row, found in results:
        by_arch.setdefault(row["arch"], []).append((row, found))
    low = []
    lines = []
    for arch, entries in sorted(by_arch.items()):
        gpu = GPUS[arch]["gpu"]
        nvcc_arch = arch + ("a" if arch == "sm_90" else "")
        lines += [
            f"#### {nvcc_arch} ({gpu})",
            "",
            "| kernel | configurations | threads | registers | spills (B) | stack (B) "
            "| shared static / dynamic (B) | occupancy | limited by |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row, found in sorted(entries, key=lambda e: e[0]["file"]):
            x, y, z = (int(v) for v in row["cube_dim"].split("x"))
            threads = x * y * z
            dynamic = int(row["shared_bytes"])
            occ, limiter = occupancy(
                arch, threads, found["registers"], found["smem_static"] + dynamic
            )
            name = os.path.basename(row["file"])[: -len(".cu")]
            lines.append(
                f"| `{name}` | {row['configs']} | {threads} | {found['registers']} "
                f"| {found['spills']} | {found['stack']} | {found['smem_static']} / {dynamic} "
                f"| {occ:.0%} | {limiter} |"
            )
            if occ < 0.25:
                low.append(f"{name} on {gpu}: {occ:.0%}, by {limiter}")
        lines.append("")
    print(
        f"cuda-offline: {len(results)} of {len(rows)} kernel sources compiled "
        f"({', '.join(f'{a}: {len(e)}' for a, e in sorted(by_arch.items()))}), "
        f"{len(failures)} failures"
    )
    if low:
        print("under 25 % occupancy:\n  " + "\n  ".join(low))
    spilling = sum(1 for _, found in results if found["spills"] > 0)
    framed = [found["stack"] for _, found in results if found["stack"] > 0]
    print(
        f"cuda-offline: {spilling} sources spill; {len(framed)} have a stack frame"
        + (f" ({min(framed)} to {max(framed)} B, the limit {MAX_STACK} B)" if framed else "")
    )
    if args.table:
        with open(args.table, "w") as f:
            f.write("\n".join(lines))
    if failures:
        print("\n\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
