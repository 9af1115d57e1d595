#!/usr/bin/env python3
"""Times the paper's own implementation (fast-transformers, PyTorch with C++/OpenMP CPU ops)
of clustered and improved clustered attention, forward, in the shapes of `crates/bench`'s
defaults, for a side-by-side comparison with `cargo run --release -p bench`.

Set-up (CPU only; torch from PyPI, fast-transformers built from its source distribution):

    python3 -m venv /tmp/ftenv
    /tmp/ftenv/bin/pip install torch==2.5.1 numpy setuptools wheel
    /tmp/ftenv/bin/pip install --no-build-isolation --no-binary :all: pytorch-fast-transformers==0.4.0
    /tmp/ftenv/bin/python scripts/fast_transformers_bench.py --lengths 1024,4096,16384,65536

Shapes: batch 1, 4 heads, E = D = 64, C = 100 clusters, topk = 32, 32 bits, 10 Lloyd
iterations, no dropout, no masking (full-length `LengthMask`s, as the bench); median of 5 timed
runs after one warm-up, under `torch.no_grad()`, with torch's intra-op threads set to the number
of cores.
"""

import argparse
import os
import statistics
import time

import torch
from fast_transformers.attention import ClusteredAttention, ImprovedClusteredAttention
from fast_transformers.masking import FullMask, LengthMask


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096,16384,65536")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--bits", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    attentions = {
        "clustered": ClusteredAttention(
            args.clusters, iterations=args.iterations, bits=args.bits, attention_dropout=0.0
        ),
        "improved": ImprovedClusteredAttention(
            args.clusters,
            iterations=args.iterations,
            bits=args.bits,
            topk=args.topk,
            attention_dropout=0.0,
        ),
    }
    print(
        f"fast-transformers forward, batch 1, {args.heads} heads, E = D = {args.dim}, "
        f"C = {args.clusters}, topk = {args.topk}, {args.bits} bits, {args.iterations} "
        f"iterations, f32; median of {args.runs} runs; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print()
    print("| L | clustered | improved |")
    print("|---:|---:|---:|")
    for length in [int(x) for x in args.lengths.split(",")]:
        shape = (1, length, args.heads, args.dim)
        queries, keys, values = (torch.randn(shape) for _ in range(3))
        attn_mask = FullMask(length, length)
        lengths = LengthMask(torch.full((1,), length, dtype=torch.int64), max_len=length)
        cells = []
        for name in ("clustered", "improved"):
            attention = attentions[name].eval()
            times = []
            with torch.no_grad():
                for run in range(args.runs + 1):
                    start = time.perf_counter()
                    attention(queries, keys, values, attn_mask, lengths, lengths)
                    elapsed = time.perf_counter() - start
                    if run > 0:
                        times.append(elapsed)
            cells.append(f"{statistics.median(times) * 1e3:.1f} ms")
        print(f"| {length} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
