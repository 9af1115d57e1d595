#!/usr/bin/env python3
"""One training step (forward, backward, Adam) of PyTorch's `nn.TransformerEncoder` and of
fast-transformers' encoder (the paper's code) in the shape of `bench --mode encoder`, each
configuration and length in a child process under the same data-segment cap, for the rows
beside this crate's encoder in docs/bench/encoder.md.

Set-up (CPU; torch from PyPI, fast-transformers built from its source distribution against it):

    python3 -m venv /tmp/ptenv
    /tmp/ptenv/bin/pip install torch numpy setuptools wheel
    /tmp/ptenv/bin/pip install --no-build-isolation pytorch-fast-transformers==0.4.0
    /tmp/ptenv/bin/python scripts/torch_encoder_bench.py --lengths 4096,16384,65536 \\
        --memory-gib 16 --out /tmp/torch-encoder.jsonl

The configurations (`--only` picks some):
- `torch`: `nn.TransformerEncoder` (batch_first, gelu), dropout 0: its attention is SDPA's flash
  kernel, which has a CPU backward (PyTorch's fastest setting here);
- `torch-checkpoint`: the same with each layer run under `torch.utils.checkpoint`
  (`use_reentrant=False`, the RNG state preserved: PyTorch's layer recomputation);
- `torch-dropout`, `torch-dropout-checkpoint`: the same two with dropout 0.1 (PyTorch's default:
  SDPA then takes its math path, which keeps the `[B, H, L, L]` weights);
- `fast-transformers`: `TransformerEncoderBuilder` with improved-clustered attention (100
  clusters, top 32, 32 bits, 10 iterations), dropout 0.1 and attention dropout 0.1.

Shape: 4 layers, d_model 256, 8 heads, d_ff 1024, batch 1, f32, input N(0, 1), loss the mean
square of the output, Adam at 1e-4; the median of `--runs` steps after `--warmup` untimed, with
torch's intra-op threads set to the number of cores. Each child's data segment is capped
(`RLIMIT_DATA`, as the Rust bench caps its children): an allocation that fails past the cap makes
the child exit with status 86, reported "over the cap", as is a child killed by SIGKILL; any
other failure is a crash with its status. Memory: the child's peak resident set size (`VmHWM`).
A configuration over the cap at one length is not run at longer ones. Results are appended to
`--out` as JSON lines; a (configuration, length) already there is not run again, so an
interrupted sitting resumes.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = [
    "torch",
    "torch-checkpoint",
    "torch-dropout",
    "torch-dropout-checkpoint",
    "fast-transformers",
]
ALLOCATION_FAILED = 86


def dropout_of(name):
    """The dropout of a configuration."""
    return 0.1 if "dropout" in name or name == "fast-transformers" else 0.0


def peak_rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def child(args):
    """Runs the steps of one (configuration, length) and prints one JSON line."""
    import torch

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    name, length = args.child, args.lengths[0]
    dropout = dropout_of(name)
    if name == "fast-transformers":
        from fast_transformers.builders import TransformerEncoderBuilder

        model = TransformerEncoderBuilder.from_kwargs(
            n_layers=args.layers,
            n_heads=args.heads,
            query_dimensions=args.d_model // args.heads,
            value_dimensions=args.d_model // args.heads,
            feed_forward_dimensions=args.d_ff,
            attention_type="improved-clustered",
            clusters=100,
            topk=32,
            bits=32,
            iterations=10,
            activation="gelu",
            dropout=dropout,
            attention_dropout=dropout,
        ).get()
        forward = model
    else:
        layer = torch.nn.TransformerEncoderLayer(
            args.d_model,
            args.heads,
            dim_feedforward=args.d_ff,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
        )
        model = torch.nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
        if name.endswith("-checkpoint"):
            from torch.utils.checkpoint import checkpoint

            def forward(x):
                for layer in model.layers:
                    x = checkpoint(layer, x, use_reentrant=False)
                return x
        else:
            forward = model
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, length, args.d_model)
    times = []
    for run in range(args.warmup + max(args.runs, 1)):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = forward(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        if run >= args.warmup:
            times.append(time.perf_counter() - start)
    print(json.dumps({"step_s": times, "peak_mib": peak_rss_mib()}))


def run_child(args, name, length, cap):
    """One child under the cap: its record."""

    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    command = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--lengths",
        str(length),
        "--runs",
        str(args.runs),
        "--warmup",
        str(args.warmup),
    ]
    record = {"config": name, "length": length, "dropout": dropout_of(name)}
    started = time.perf_counter()
    done = subprocess.run(command, preexec_fn=limit, capture_output=True, text=True)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    if done.returncode == 0:
        report = json.loads(done.stdout.strip().splitlines()[-1])
        record["step_s"] = statistics.median(report["step_s"])
        record["peak_mib"] = report["peak_mib"]
    elif done.returncode == ALLOCATION_FAILED or done.returncode == -9:
        record["note"] = "over the cap"
    else:
        record["note"] = f"crash: status {done.returncode}"
        record["stderr_tail"] = done.stderr[-2000:]
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--memory-gib", type=float, default=16.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default="torch-encoder.jsonl")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.child:
        try:
            child(args)
        except (MemoryError, RuntimeError) as error:
            if isinstance(error, MemoryError) or "allocate" in str(error) or "memory" in str(error):
                print(f"allocation failed: {error}", file=sys.stderr)
                sys.stderr.flush()
                os._exit(ALLOCATION_FAILED)
            raise
        return
    unknown = [c for c in args.only.split(",") if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configurations {unknown} (known: {', '.join(CONFIGS)})")
    done = {}
    if os.path.exists(args.out):
        with open(args.out) as old:
            done = {(r["config"], r["length"]): r for r in map(json.loads, old)}
    cap = int(args.memory_gib * 1024**3)
    for name in args.only.split(","):
        for length in args.lengths:
            record = done.get((name, length))
            if record is None:
                record = run_child(args, name, length, cap)
                print(json.dumps(record), flush=True)
                with open(args.out, "a") as out:
                    out.write(json.dumps(record) + "\n")
            if "note" in record:
                break


if __name__ == "__main__":
    main()
