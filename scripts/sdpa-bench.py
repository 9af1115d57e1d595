#!/usr/bin/env python3
"""Times PyTorch's scaled_dot_product_attention on the shapes the CUDA benchmark uses.

The attention a user would pick instead of clustered attention: FlashAttention (PyTorch's flash
kernel) for f16/bf16, the memory-efficient kernel for f32 (flash takes no f32). Batch 1, queries
= keys = values = [1, heads, L, 64], no mask. `forward` times the attention alone, `train` the
forward and the backward of its three inputs, as the crate's `bench --mode train` does.

Use: python3 sdpa-bench.py --heads 4,8 --lengths 16384,65536 --dtypes bf16,f32 [--runs 5]
Prints one CSV line per measurement, `dtype,heads,length,mode,kernel,median_ms`, the median of
`--runs` timed runs after two warm-up runs, each run timed by CUDA events.

`python3 sdpa-bench.py --ratios SDPA_CSV BENCH_CSV...` instead prints a markdown table of the
crate's times (the CSV files `bench --out-dir` writes) over SDPA's on the same dtype, heads,
length and mode: below 1 means faster than SDPA. It needs no GPU.
"""
import argparse
import csv
import statistics
import sys

try:  # Only the timing needs torch; `--ratios` runs anywhere.
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    torch = None

DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def numbers(text):
    return [int(x) for x in text.split(",") if x]


def time_ms(step, runs):
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ratios(sdpa_csv, bench_csvs):
    """Markdown table: each bench measurement's median over SDPA's (same dtype, heads, L, mode)."""
    sdpa = {}
    with open(sdpa_csv) as f:
        for row in csv.DictReader(f):
            key = (row["dtype"], int(row["heads"]), int(row["length"]), row["mode"])
            sdpa[key] = (float(row["median_ms"]), row["kernel"])
    print("| backend | dtype | mode | heads | L | op | ours (ms) | SDPA (ms) | ours / SDPA |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|")
    for path in bench_csvs:
        with open(path) as f:
            for row in csv.DictReader(f):
                if not row.get("median_s"):
                    continue
                key = (row["dtype"], int(row["heads"]), int(row["length"]), row["mode"].lower())
                if key not in sdpa:
                    continue
                ours = float(row["median_s"]) * 1e3
                theirs, kernel = sdpa[key]
                backend = row["backend"]
                if row.get("score_products", "multiply-add") not in ("", "multiply-add"):
                    backend += f" ({row['score_products']})"
                print(
                    f"| {backend} | {key[0]} | {key[3]} | {key[1]} | {key[2]} | {row['op']} "
                    f"| {ours:.2f} | {theirs:.2f} ({kernel}) | {ours / theirs:.3f} |"
                )


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--ratios":
        ratios(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=numbers, default=[8])
    parser.add_argument("--lengths", type=numbers, default=[16384, 65536])
    parser.add_argument("--dtypes", default="bf16,f32")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", default="forward,train")
    args = parser.parse_args()
    if torch is None or not torch.cuda.is_available():
        sys.exit("sdpa-bench: torch sees no CUDA device")
    print("dtype,heads,length,mode,kernel,median_ms", flush=True)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, DTYPES[name])
        backend = SDPBackend.EFFICIENT_ATTENTION if dtype == torch.float32 else SDPBackend.FLASH_ATTENTION
        kernel = "memory-efficient" if dtype == torch.float32 else "flash"
        for heads in args.heads:
            for length in args.lengths:
                shape = (1, heads, length, args.dim)
                q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
                grad = torch.randn(shape, device="cuda", dtype=dtype)
                for mode in args.modes.split(","):
                    with sdpa_kernel([backend]):
                        if mode == "forward":
                            with torch.no_grad():
                                ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v), args.runs)
                        else:
                            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

                            def step():
                                out = F.scaled_dot_product_attention(qg, kg, vg)
                                out.backward(grad)
                                qg.grad = kg.grad = vg.grad = None

                            ms = time_ms(step, args.runs)
                    print(f"{name},{heads},{length},{mode},{kernel},{ms:.3f}", flush=True)
                del q, k, v, grad
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
