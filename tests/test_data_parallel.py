"""End to end: `nanoserve serve --data-parallel-size 2` (two engine cores, one CPU each) on SmolLM2:
requests spread over both cores, repeated prefixes go back to the core that cached them, seeded output
equals one core's, a disconnect frees blocks on its core, and a killed core stops the server."""
import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.server

ARGS = ("--max-model-len", "512", "--kv-cache-memory", "0.1")
SYSTEM = ["You are a careful assistant for a travel agency. Answer briefly and name the country first. " * 2,
          "You are a chemistry tutor. Explain each step, use simple words, and check the units twice. " * 2]


@pytest.fixture(scope="module")
def dp_server():
    proc = ServerProcess("--data-parallel-size", "2", *ARGS)
    yield proc
    proc.stop()


def per_engine(server: ServerProcess, name: str) -> list[float]:
    text = httpx.get(f"{server.url}/metrics").text
    found = {int(m.group(1)): float(m.group(2)) for m in
             re.finditer(rf'^nanoserve:per_engine_{name}{{engine="(\d+)"}} (\S+)$', text, re.M)}
    return [found.get(i, 0.0) for i in range(2)]


def eventually(read, ok, timeout: float = 10.0):
    """`read()` once `ok` holds for it, or its last value after `timeout` s: engine gauges follow the
    engine's stats a moment after the answers."""
    deadline = time.monotonic() + timeout
    while not ok(value := read()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def complete(server: ServerProcess, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_launcher_pins_each_core_to_its_own_cpu(dp_server):
    log = dp_server.output()
    assert "engine-core-0: pinned to CPU(s) 0, 1 compute thread(s)" in log
    assert "engine-core-1: pinned to CPU(s) 1, 1 compute thread(s)" in log
    assert "2 engine core(s), prefix affinity on" in log


def test_requests_spread_over_both_cores(dp_server):
    before = per_engine(dp_server, "prefix_cache_queries")
    prompts = [f"Request number {i} asks about a different thing entirely: " + "word " * (20 + 7 * i)
               for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: complete(dp_server, p, max_tokens=24), prompts))
    after = eventually(lambda: per_engine(dp_server, "prefix_cache_queries"),
                       lambda now: all(a > b for a, b in zip(now, before)))
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_repeated_prefixes_land_on_the_core_that_cached_them(dp_server):
    queries, hits = per_engine(dp_server, "prefix_cache_queries"), per_engine(dp_server, "prefix_cache_hits")
    for turn in range(3):
        for system in SYSTEM:
            complete(dp_server, f"{system}\nUser {turn}: hello?")
    d_hits = eventually(lambda: [a - b for a, b in zip(per_engine(dp_server, "prefix_cache_hits"), hits)],
                        lambda now: sum(now) >= 4 * 32)
    d_queries = [a - b for a, b in zip(per_engine(dp_server, "prefix_cache_queries"), queries)]
    # Each system prompt is 2+ blocks; turns 2 and 3 of each find them where turn 1 left them.
    assert sum(d_hits) >= 4 * 32, (d_queries, d_hits)
    assert all(q > 0 for q in d_queries)  # the two prompts went to different cores (least loaded first)
    total = httpx.get(f"{dp_server.url}/metrics").text
    assert re.search(r"^nanoserve:prefix_cache_hits \S+$", total, re.M)  # and the summed series exists


def test_seeded_output_equals_one_cores():
    """n=2 too: both completions of a request run on one core."""
    prompts = [f"Write a short story about a {animal}." for animal in ("cat", "dog", "fox", "owl")]
    body = dict(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, n=2)
    texts = {}
    for args in (("--data-parallel-size", "2"), ("--cpus-per-engine", "1")):
        server = ServerProcess(*args, *ARGS)
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                outs = list(pool.map(lambda p: complete(server, p, **body), prompts))
            texts[args] = [[c["text"] for c in o["choices"]] for o in outs]
        finally:
            server.stop()
    assert texts[("--data-parallel-size", "2")] == texts[("--cpus-per-engine", "1")]


def test_a_disconnect_frees_blocks_on_its_core(dp_server):
    long = {"prompt": "Count slowly to one thousand.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{dp_server.url}/v1/completions", json=long, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        deadline = time.monotonic() + 10
        while sum(running := per_engine(dp_server, "num_requests_running")) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(running) == [0.0, 1.0]
        core = running.index(1.0)
        assert eventually(lambda: per_engine(dp_server, "kv_cache_usage_perc")[core], lambda v: v > 0) > 0
    deadline = time.monotonic() + 10  # the client went away: that core aborts the request and frees its blocks
    while per_engine(dp_server, "kv_cache_usage_perc")[core] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert per_engine(dp_server, "kv_cache_usage_perc")[core] == 0
    assert per_engine(dp_server, "num_requests_running")[core] == 0


def test_a_killed_core_ends_in_flight_requests_and_the_server_exits_non_zero():
    server = ServerProcess("--data-parallel-size", "2", *ARGS)
    try:
        long = {"max_tokens": 400, "ignore_eos": True, "stream": True}
        bodies = {}

        def stream(prompt):
            with httpx.stream("POST", f"{server.url}/v1/completions", json={**long, "prompt": prompt},
                              timeout=60) as r:
                bodies[prompt] = "\n".join(r.iter_lines())

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(stream, p) for p in ("Go on forever.", "Keep talking about rivers.")]
            deadline = time.monotonic() + 15
            while per_engine(server, "num_requests_running") != [1.0, 1.0] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert per_engine(server, "num_requests_running") == [1.0, 1.0]  # one on each core
            pid = int(re.search(r"engine-core-1\[(\d+)\]", server.output()).group(1))
            os.kill(pid, signal.SIGKILL)
            for f in futures:
                f.result(60)
        for body in bodies.values():  # the stream on the killed core and the one on the live core
            assert '"error"' in body and body.rstrip().endswith("data: [DONE]"), body[-300:]
        assert server.proc.wait(30) != 0
    finally:
        server.stop()
