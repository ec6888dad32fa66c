"""A kernel change measured against a git revision in one process: both builds loaded side by side (the
revision's kernel sources and the working tree's, each compiled as the engine compiles them), the same
product called on each in turn, round after round, on weights cycled through copies (read from memory as
in a model step). On a shared host whose speed drifts by 10-30% over minutes, runs minutes apart cannot
show a change of a few percent; alternating call by call can (the same build against itself reads
0.98-1.01x, its quartiles within ~3%).
Usage: python scripts/kernels_ab.py [--base REV | --base-dir DIR] [--types Q4_K,Q6_K] [--n 8192] [--k 2048] [--rows 32,128]
Prints per type and row count the median time of each build and the median of the paired ratios
base / working tree (above 1: the working tree is faster), with their quartiles."""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from nanoserve.kernels import abi, build
from nanoserve.kernels.backend import CKernelBackend
from nanoserve.kernels.quant import random_weight
from nanoserve.model.layers import Linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = "src/nanoserve/kernels"


def sources_at(rev: str, into: str) -> str:
    """The kernel sources (build.SOURCES + build.HEADERS) of revision `rev`, written under `into`."""
    for name in build.SOURCES + build.HEADERS:
        text = subprocess.run(["git", "show", f"{rev}:{KERNELS}/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        with open(os.path.join(into, name), "wb") as f:
            f.write(text)
    return into


def backend_from(kernel_dir: str, threads: int) -> CKernelBackend:
    """The C backend compiled from the sources in `kernel_dir` (cached by their build key, as the engine's)."""
    lib, key, target = build.load_library(source_dir=kernel_dir)
    abi.bind(lib)
    return CKernelBackend(lib, key, target.name, threads)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree's kernels with")
    ap.add_argument("--base-dir", default=None, help="a directory of kernel sources to compare with, instead of "
                    "a revision (an experiment kept outside git)")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--n", type=int, default=8192, help="output features (weight rows)")
    ap.add_argument("--k", type=int, default=2048, help="input features")
    ap.add_argument("--rows", default="32,128", help="rows of x, comma-separated")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--copies-mib", type=int, default=256, help="weights cycled through this much memory")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = backend_from(args.base_dir or sources_at(args.base, tmp), args.threads)
        work = backend_from(os.path.join(ROOT, KERNELS), args.threads)
    print(f"base {args.base_dir or args.base} ({base.build_key}) against the working tree ({work.build_key})", flush=True)
    if base.build_key == work.build_key:
        print("the working tree's kernels are the base's: nothing to compare", file=sys.stderr)
    for t in args.types.split(","):
        w = random_weight(t, args.n, args.k)
        copies = max(1, (args.copies_mib << 20) // (w.data.numel() * w.data.element_size()))
        layers = []
        for c in range(copies):
            layer = Linear(args.k, args.n)
            layer.set_weight([w if c == 0 else random_weight(t, args.n, args.k, seed=c)])
            layers.append(layer)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.k)
            times: dict[str, list[float]] = {"base": [], "work": []}
            i = 0
            for r in range(args.rounds):
                order = (("base", base), ("work", work)) if r % 2 == 0 else (("work", work), ("base", base))
                for name, be in order:
                    start = time.perf_counter()
                    for _ in range(3):
                        be.linear(x, layers[i % len(layers)], True)
                        i += 1
                    times[name].append((time.perf_counter() - start) / 3)
            ratios = sorted(a / b for a, b in zip(times["base"], times["work"]))
            q = len(ratios) // 4
            print(f"{t} {args.n}x{args.k} rows {rows}: base {statistics.median(times['base']) * 1e3:.3f} ms, "
                  f"working tree {statistics.median(times['work']) * 1e3:.3f} ms, base / working tree "
                  f"{statistics.median(ratios):.3f}x (quartiles {ratios[q]:.3f}-{ratios[-q - 1]:.3f})", flush=True)


if __name__ == "__main__":
    main()
