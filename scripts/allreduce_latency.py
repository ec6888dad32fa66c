"""All-reduce latency with torch.distributed (gloo) between 2 processes on this machine's loopback, for
the vectors tensor parallelism would reduce twice per layer per decode step: one token's hidden state
(SmolLM2: 576 floats; a 7-8B Llama: 4096) and a batch of 32. Prints microseconds per all-reduce."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (576, 4096, 32 * 576, 32 * 4096)


def worker(rank: int, port: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for size in SIZES:
        x = torch.ones(size)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        took = (time.perf_counter() - start) / repeats
        if rank == 0:
            print(f"| {size} floats ({size * 4 / 1024:.1f} KiB) | {took * 1e6:.0f} us |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print("| all-reduce of | time (2 processes, gloo, loopback) |\n|---|---|")
    mp.spawn(worker, args=(29511, int(sys.argv[1]) if len(sys.argv) > 1 else 500), nprocs=2)
