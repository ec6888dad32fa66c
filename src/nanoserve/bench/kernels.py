"""`nanoserve bench kernels`: the C backend's matrix products on each weight type, as the engine runs them
(int8 activations on block types, float32 on F16/BF16/F32), for decode steps and a prompt, each product on
its own copy of the weights, read from memory as a model step reads them; the weights' bytes read per
second against the machine's read bandwidth, measured in the same run (a float32 sum over as many bytes),
and multiply-adds per second (the measure for prompt-sized steps, which are bound by compute).
`--attention` times the paged decode attention instead, on a float16 cache of as many layers as a model's."""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from nanoserve.engine.core import keep_freed_memory
from nanoserve.kernels.backend import CKernelBackend, select_backend
from nanoserve.kernels.quant import FLOAT_TYPES, QuantWeight, from_float, random_blocks, stack_rows
from nanoserve.model.layers import KVCache, Linear

DEFAULT_TYPES = "Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K,F16,BF16"


def bench_weight(qtype: str, rows: int, k: int) -> QuantWeight:
    if qtype in FLOAT_TYPES:
        return from_float(torch.randn(rows, k) * 0.02, qtype)
    return random_blocks(qtype, rows, k)


def weight_copies(w: QuantWeight, total_bytes: int) -> list[Linear]:
    """Layers on copies of `w` in weight memory (as the loader's: 2 MiB pages), together at least
    `total_bytes`: the products cycle through them, so that each reads its weights from memory. On one
    matrix 2.3x a 32 MiB L3, repeated, a third of the reads hit the L3 (Q4_K one row: 38 GB/s, above the 35
    GB/s a 1 GiB sum reads from memory)."""
    layers = []
    for _ in range(max(1, -(-total_bytes // w.nbytes))):
        layer = Linear(w.k, w.shape[0])
        layer.set_weight([QuantWeight(w.qtype, stack_rows([w.data]), w.k)])
        layers.append(layer)
    return layers


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


def bench_attention(backend: CKernelBackend, shape: str, batch: int, ctx: int, layers: int, repeats: int,
                    block_size: int = 16) -> None:
    """Decode attention of `batch` rows of ~ctx positions each (the last row ctx - 2 (batch - 1)), one call
    per layer over `layers` float16 caches (each call reads its layer's keys and values from memory, as in
    a model step), the slots in blocks of block_size in random order as the block manager hands them out."""
    heads, kv_heads, head_dim = (int(v) for v in shape.split(","))
    g = torch.Generator().manual_seed(0)
    blocks_per_row = -(-ctx // block_size)
    num_slots = batch * (blocks_per_row + 1) * block_size
    caches = []
    for _ in range(layers):
        cache = KVCache(kv_heads, num_slots, head_dim, torch.float16)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        caches.append(cache)
    blocks = torch.randperm(num_slots // block_size, generator=g)[: batch * blocks_per_row]
    slots = (blocks.view(batch, -1, 1) * block_size + torch.arange(block_size)).view(batch, -1)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int64) - 2 * torch.arange(batch)
    q = torch.randn(batch, heads, head_dim, generator=g)

    def step():
        for cache in caches:
            backend.decode_attention(q, cache, slots, ctx_lens, head_dim ** -0.5)

    t = best_time(step, repeats) / layers
    positions = int(ctx_lens.sum())
    kv_bytes = positions * kv_heads * head_dim * 2 * 2  # keys and values, float16
    macs = positions * heads * head_dim * 2  # scores and the weighted sum of values
    print(f"decode attention, {heads} heads / {kv_heads} KV heads x {head_dim}, {batch} rows of ~{ctx} positions, "
          f"float16 cache, {layers} layers: {t * 1e6:.1f} us per layer, KV read {kv_bytes / t / 1e9:.1f} GB/s, "
          f"{macs / t / 1e9:.1f} G multiply-adds/s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="nanoserve bench kernels", description=__doc__)
    ap.add_argument("--types", default=DEFAULT_TYPES, help="comma-separated GGUF types")
    ap.add_argument("--rows", default="1,2,64", help="rows of x per product (comma-separated)")
    ap.add_argument("--n", type=int, default=65536, help="weight rows")
    ap.add_argument("--copies-mib", type=int, default=512,
                    help="weights cycled through per type, MiB (each product reads the next copy: many times the L3)")
    ap.add_argument("--k", type=int, default=2048, help="weight columns (a multiple of 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON line per measurement")
    ap.add_argument("--attention", metavar="HEADS,KV_HEADS,HEAD_DIM",
                    help="time the decode attention of this shape instead (SmolLM2: 9,3,64; TinyLlama: 32,4,64)")
    ap.add_argument("--batch", type=int, default=32, help="--attention: rows (sequences) per call")
    ap.add_argument("--ctx", type=int, default=160, help="--attention: positions each row attends to")
    ap.add_argument("--layers", type=int, default=30, help="--attention: layers (caches) cycled through")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    backend = select_backend("c", args.num_threads)
    assert isinstance(backend, CKernelBackend)
    if args.attention:
        bench_attention(backend, args.attention, args.batch, args.ctx, args.layers, args.repeats)
        return
    keep_freed_memory()  # as the engine: each call's output reuses the last one's pages
    probe = torch.empty(max(args.copies_mib << 20, args.n * args.k * 2) // 4, dtype=torch.float32).uniform_()
    bandwidth = probe.numel() * 4 / best_time(lambda: probe.sum(), args.repeats)
    del probe
    print(f"read bandwidth (float32 sum, {args.num_threads} threads): {bandwidth / 1e9:.1f} GB/s")
    rows_list = [int(r) for r in args.rows.split(",")]
    print("| type | rows | ms | weight GB/s | share of bandwidth | G multiply-adds/s |")
    print("|---|---|---|---|---|---|")
    for qtype in args.types.split(","):
        w = bench_weight(qtype.strip().upper(), args.n, args.k)
        int8 = w.qtype not in FLOAT_TYPES
        layers = itertools.cycle(weight_copies(w, args.copies_mib << 20))
        for rows in rows_list:
            x = torch.randn(rows, args.k)
            t = best_time(lambda: backend.linear(x, next(layers), int8), args.repeats if rows < 16 else 1)
            rate, macs = w.nbytes / t, args.n * args.k * rows / t
            if args.json:
                print(json.dumps({"type": w.qtype, "rows": rows, "ms": t * 1e3, "weight_gb_per_s": rate / 1e9,
                                  "bandwidth_gb_per_s": bandwidth / 1e9, "gmac_per_s": macs / 1e9}))
            else:
                print(f"| {w.qtype} | {rows} | {t * 1e3:.2f} | {rate / 1e9:.1f} | {rate / bandwidth:.0%} | {macs / 1e9:.0f} |")
        del w, layers


if __name__ == "__main__":
    main()
