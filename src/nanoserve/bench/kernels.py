"""`nanoserve bench kernels`: the C backend's matrix products on each weight type, as the engine runs them
(int8 activations on block types, float32 on F16/BF16/F32), for decode steps and a prompt, on weights
larger than the L3 cache as a model's are; the weights' bytes read per second against the machine's read
bandwidth, measured in the same run (a float32 sum over as many bytes), and multiply-adds per second (the
measure for prompt-sized steps, which are bound by compute)."""
from __future__ import annotations

import argparse
import json
import time

import torch

from nanoserve.kernels.backend import CKernelBackend, select_backend
from nanoserve.kernels.quant import FLOAT_TYPES, QuantWeight, from_float, random_blocks

DEFAULT_TYPES = "Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K,F16,BF16"


def bench_weight(qtype: str, rows: int, k: int) -> QuantWeight:
    if qtype in FLOAT_TYPES:
        return from_float(torch.randn(rows, k) * 0.02, qtype)
    return random_blocks(qtype, rows, k)


def best_time(fn, repeats: int, rounds: int = 5) -> float:
    """The fastest of `rounds` means over `repeats` calls (the machine is shared: the minimum is the signal)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="nanoserve bench kernels", description=__doc__)
    ap.add_argument("--types", default=DEFAULT_TYPES, help="comma-separated GGUF types")
    ap.add_argument("--rows", default="1,2,64", help="rows of x per product (comma-separated)")
    ap.add_argument("--n", type=int, default=65536, help="weight rows (the default, 2048 wide, is >= 4x a 32 MiB L3)")
    ap.add_argument("--k", type=int, default=2048, help="weight columns (a multiple of 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON line per measurement")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    backend = select_backend("c", args.num_threads)
    assert isinstance(backend, CKernelBackend)
    probe = torch.empty(args.n * args.k // 2, dtype=torch.float32).uniform_()  # 2 bytes per weight
    bandwidth = probe.numel() * 4 / best_time(lambda: probe.sum(), args.repeats)
    del probe
    print(f"read bandwidth (float32 sum, {args.num_threads} threads): {bandwidth / 1e9:.1f} GB/s")
    rows_list = [int(r) for r in args.rows.split(",")]
    print("| type | rows | ms | weight GB/s | share of bandwidth | G multiply-adds/s |")
    print("|---|---|---|---|---|---|")
    for qtype in args.types.split(","):
        w = bench_weight(qtype.strip().upper(), args.n, args.k)
        int8 = w.qtype not in FLOAT_TYPES
        for rows in rows_list:
            x = torch.randn(rows, args.k)
            t = best_time(lambda: backend.weight_linear(x, w, int8), args.repeats if rows < 16 else 1)
            rate, macs = w.nbytes / t, args.n * args.k * rows / t
            if args.json:
                print(json.dumps({"type": w.qtype, "rows": rows, "ms": t * 1e3, "weight_gb_per_s": rate / 1e9,
                                  "bandwidth_gb_per_s": bandwidth / 1e9, "gmac_per_s": macs / 1e9}))
            else:
                print(f"| {w.qtype} | {rows} | {t * 1e3:.2f} | {rate / 1e9:.1f} | {rate / bandwidth:.0%} | {macs / 1e9:.0f} |")
        del w


if __name__ == "__main__":
    main()
