#!/usr/bin/env python3
"""Compiles the CUDA sources of the crate's kernels with NVRTC, as cubecl-cuda 0.11.3 does at
run time, on a machine without GPU, and reports each kernel's registers, spills, shared memory
and the occupancy they allow on an A100 (sm_80) and an H100 (sm_90a).

Use: cuda_offline.py KERNELS_DIR CUDA_PATH [--table FILE] [--jobs N]
     cuda_offline.py --probe LIBNVRTC CUDA_PATH   (whether NVRTC compiles a kernel that
                    includes the headers of CUDA_PATH; the CUDA kit's run.sh asks it)
     cuda_offline.py --self-test   (reads the literal ptxas logs of SELF_TEST and checks what
                    it finds and which fail; no NVRTC; scripts/cuda-offline.sh runs it first)

KERNELS_DIR holds what the test `cuda_sources_compile_for_sm_80_and_sm_90` wrote with
`CUDA_KERNELS_DIR` set (kernels.tsv and the .cu files); CUDA_PATH is a CUDA tree with include/
(the headers cubecl's sources include) and lib/libnvrtc.so.* (the pinned PyPI wheels of
scripts/cuda-offline.sh). The flags are cubecl-cuda's (`compute/context.rs`, `compile_to_ptx`:
`--gpu-architecture=sm_{arch}` with an `a` from 90 on, the include paths, `-lineinfo`) plus
`--ptxas-options=-v`, which makes NVRTC compile to a cubin and report the resources of every
function: the entry function's, and those of any function it calls that ptxas did not inline
(or of a second kernel), each in a block of its own. Exits 1 when a source does not compile,
or any function of it spills registers to local memory or has a stack frame over MAX_STACK
bytes.
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


# ptxas's verbose report, line by line: each function it compiles gets a block, "Function
# properties for NAME" and the line of its stack frame and spills; an entry function (a kernel)
# is announced by "Compiling entry function 'NAME' for 'sm_80'" and followed by the line of its
# registers. A function the kernel calls and ptxas did not inline gets a block of its own, before
# or after the kernel's, as does each further kernel of the source.
ENTRY = re.compile(r"Compiling entry function '([^']+)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def functions(log):
    """Every function block of ptxas's verbose log, in its order: name, whether it is an entry
    function, stack frame and spill bytes (stores + loads) and, for an entry function, its
    registers and static shared memory (None and 0 where the log gives none)."""
    blocks = {}

    def block(name):
        return blocks.setdefault(
            name, dict(name=name, entry=False, registers=None, smem_static=0, stack=0, spills=0)
        )

    entry = current = None
    for line in log.splitlines():
        found = ENTRY.search(line)
        if found:
            entry = current = found.group(1)
            block(entry)["entry"] = True
            continue
        found = PROPERTIES.search(line)
        if found:
            current = found.group(1)
            block(current)
            continue
        found = FRAME.search(line)
        if found:
            b = block(current or entry or "?")
            b["stack"] = int(found.group(1))
            b["spills"] = int(found.group(2)) + int(found.group(3))
            b["framed"] = True
            continue
        found = USED.search(line)
        if found:
            # The registers line closes an entry function's report, whatever blocks of the
            # functions it calls came between.
            b = block(entry or current or "?")
            b["registers"] = int(found.group(1))
            b["smem_static"] = int(found.group(2) or 0)
    return list(blocks.values())


def resources(log):
    """Registers and static shared memory of the entry function (the one with the most
    registers, where a source has several), and the worst stack frame and spill bytes (stores +
    loads) of every function in ptxas's verbose log, with the functions they are in and every
    block as `functions` read it."""
    blocks = functions(log)
    used = [b for b in blocks if b["registers"] is not None]
    framed = [b for b in blocks if b.pop("framed", False)]
    if not used or not framed:
        return None
    kernel = max(used, key=lambda b: (b["entry"], b["registers"]))
    spilled = max(framed, key=lambda b: b["spills"])
    stacked = max(framed, key=lambda b: b["stack"])
    return dict(
        registers=kernel["registers"],
        smem_static=kernel["smem_static"],
        stack=stacked["stack"],
        spills=spilled["spills"],
        spilled=spilled["name"] if spilled["spills"] > 0 else None,
        stacked=stacked["name"] if stacked["stack"] > 0 else None,
        functions=blocks,
    )


def problem(found):
    """Why a source's resources fail the check (a function that spills, or a stack frame over
    MAX_STACK in any function), or None."""
    if found["spills"] > 0:
        return (
            f"spills {found['spills']} B in {found['spilled']} "
            f"({found['registers']} registers)"
        )
    if found["stack"] > MAX_STACK:
        return (
            f"a stack frame of {found['stack']} B in {found['stacked']}, over {MAX_STACK} B"
        )
    return None


def blocks_line(found):
    """The functions of ptxas's report, one after another: registers, stack, spills."""
    return "; ".join(
        f"{b['name']} ({'entry, ' + str(b['registers']) + ' registers, ' if b['entry'] else ''}"
        f"stack {b['stack']} B, spills {b['spills']} B)"
        for b in found["functions"]
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


# ptxas's verbose logs as NVRTC returns them, with what `resources` must read from each and
# whether the source fails: (what the log is, log, registers, spills, stack, function that
# spills, fails).
SELF_TEST = [
    (
        "one kernel, no spill",
        """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'lsh_hash_kernel' for 'sm_80'
ptxas info    : Function properties for lsh_hash_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 392 bytes cmem[0]
""",
        40, 0, 0, None, False,
    ),
    (
        "a kernel and a function it calls, no spill",
        """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'topk_kernel' for 'sm_90a'
ptxas info    : Function properties for topk_kernel
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for _Z13insert_sortedPfPjfj
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
""",
        96, 0, 16, None, False,
    ),
    (
        "a kernel and a function it calls, the second spills",
        """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'topk_kernel' for 'sm_80'
ptxas info    : Function properties for topk_kernel
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for _Z13insert_sortedPfPjfj
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
""",
        96, 16, 16, "_Z13insert_sortedPfPjfj", True,
    ),
    (
        "the called function's block first, then the kernel's; the called one spills",
        """ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z13insert_sortedPfPjfj
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function 'topk_kernel' for 'sm_80'
ptxas info    : Function properties for topk_kernel
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
""",
        96, 16, 16, "_Z13insert_sortedPfPjfj", True,
    ),
    (
        "a called function with a stack frame over MAX_STACK",
        """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'topk_kernel' for 'sm_80'
ptxas info    : Function properties for topk_kernel
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for _Z13insert_sortedPfPjfj
    2048 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
""",
        96, 0, 2048, None, True,
    ),
    (
        "two kernels, the second spills",
        """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kmeans_assign_kernel' for 'sm_80'
ptxas info    : Function properties for kmeans_assign_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'kmeans_update_kernel' for 'sm_80'
ptxas info    : Function properties for kmeans_update_kernel
    24 bytes stack frame, 24 bytes spill stores, 32 bytes spill loads
ptxas info    : Used 255 registers, 380 bytes cmem[0]
""",
        255, 56, 24, "kmeans_update_kernel", True,
    ),
]


def self_test():
    """Checks `resources` and `problem` on the logs of SELF_TEST; says so on standard output,
    and what went wrong on standard error."""
    wrong = []
    for what, log, registers, spills, stack, spilled, fails in SELF_TEST:
        found = resources(log)
        expected = dict(registers=registers, spills=spills, stack=stack, spilled=spilled)
        got = {k: found.get(k) for k in expected} if found else None
        if got != expected:
            wrong.append(f"{what}: read {got}, expected {expected}")
        elif bool(problem(found)) != fails:
            wrong.append(f"{what}: {'passes' if fails else 'fails'} ({problem(found)})")
    if wrong:
        print("cuda-offline: self-test FAILED:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return False
    print(f"cuda-offline: self-test passed ({len(SELF_TEST)} ptxas logs read)")
    return True


def main():
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(0 if self_test() else 1)
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
            elif problem(found):
                failures.append(
                    f"{row['file']} ({row['configs']}): {problem(found)}\n"
                    f"  functions: {blocks_line(found)}\n{log}"
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
