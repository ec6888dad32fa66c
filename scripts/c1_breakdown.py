"""Where a single stream's time goes: serves the default model, streams `bench serve --concurrency 1`,
and reads each process's threads from /proc/<pid>/task/*/schedstat before and after. Prints, per output
token, the CPU time, the time runnable but waiting for a core (run-queue delay) and the times scheduled,
for the engine core (its loop, IO and compute threads) and the API server, next to the client's ITL.

Usage: .venv/bin/python scripts/c1_breakdown.py [extra `nanoserve serve` flags...]"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request

from nanoserve.bench.serve import run

PORT = 8051
NUM_PROMPTS, OUTPUT_LEN = 6, 128


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def threads(pid: int) -> dict[str, tuple[int, int, int]]:
    """Thread name (numbered when repeated) -> (CPU ns, run-queue wait ns, times scheduled)."""
    found: dict[str, tuple[int, int, int]] = {}
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu, wait, slices = (int(v) for v in f.read().split())
        except FileNotFoundError:
            continue
        key = name if tid != str(pid) else "main"
        n = 1
        while key in found:
            n += 1
            key = f"{name}#{n}"
        found[key] = (cpu, wait, slices)
    return found


def wait_up(url: str) -> None:
    for _ in range(240):
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def main() -> None:
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "nanoserve"), "serve", "--port",
                               str(PORT), *sys.argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{PORT}"
        wait_up(url + "/health")
        kids = [c for c in children(server.pid) if "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]
        engine = max(kids, key=rss_kib)  # the one holding the weights and the KV cache
        procs = {"engine core": engine, **{f"API server {i}": c for i, c in enumerate(k for k in kids if k != engine)},
                 "launcher": server.pid}
        asyncio.run(run(url, None, 1, 2, 100, 16, {0: -100, 2: -100}))  # warm-up
        before = {name: threads(pid) for name, pid in procs.items()}
        report = asyncio.run(run(url, None, 1, NUM_PROMPTS, 100, OUTPUT_LEN, {0: -100, 2: -100}))
        after = {name: threads(pid) for name, pid in procs.items()}
    finally:
        server.terminate()
        server.wait(60)
    tokens = NUM_PROMPTS * OUTPUT_LEN
    print(f"client: {report['output_tok_per_s']:.1f} tok/s, ITL p50 {report['itl_p50'] * 1e3:.2f} ms, "
          f"p99 {report['itl_p99'] * 1e3:.2f} ms, TTFT p50 {report['ttft_p50'] * 1e3:.0f} ms; wall "
          f"{report['wall_s'] / tokens * 1e3:.2f} ms per token\n")
    print("| process | thread | CPU ms/token | run-queue wait ms/token | scheduled /token |\n|---|---|---|---|---|")
    for name in procs:
        for thread, (cpu, wait, slices) in after[name].items():
            cpu0, wait0, slices0 = before[name].get(thread, (0, 0, 0))
            if slices - slices0 == 0:
                continue
            print(f"| {name} | {thread} | {(cpu - cpu0) / tokens / 1e6:.3f} | {(wait - wait0) / tokens / 1e6:.3f} | "
                  f"{(slices - slices0) / tokens:.2f} |")


if __name__ == "__main__":
    main()
