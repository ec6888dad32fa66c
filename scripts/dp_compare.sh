#!/bin/bash
# Data-parallel engine cores side by side, one server at a time on this machine, same load, on a
# shared-prefix workload (16 system prompts of 400 words, each request one of them and 50 words of its
# own): 8 requests always in flight, and up to 32 arriving at 2 a second (Poisson; with all 32 sent at once
# and equal output lengths, requests end in waves and routing can only balance load). With 1 engine core
# (2 threads), 2 cores pinned to one CPU each with prefix affinity, and 2 without it (least loaded only).
# Reports throughput, TTFT and the prefix-cache hit rate. Each level on a fresh server, so that no level
# finds the prompts of the one before in the cache.
cd "$(dirname "$0")/.."
B=".venv/bin/nanoserve bench serve --workload shared-prefix --num-prefixes 16 --prefix-len 400 --input-len 50 --output-len 64 --num-prompts 96"
. scripts/wait_up.sh
run() {  # label, serve flags...
    local label=$1; shift
    for rate in 0 2; do
        .venv/bin/nanoserve serve --port 8041 "$@" > /tmp/bench-dp.log 2>&1 &
        wait_up http://127.0.0.1:8041/health
        if [ $rate = 0 ]; then
            $B --url http://127.0.0.1:8041 --concurrency 8 --label "$label"
        else
            $B --url http://127.0.0.1:8041 --concurrency 32 --request-rate $rate --label "$label, $rate req/s"
        fi
        pkill -f "nanoserve serve --port 8041"; sleep 3
    done
}
[ -z "$ONLY_AFFINITY" ] && run "1 engine core"
run "2 engine cores, prefix affinity" --data-parallel-size 2
[ -z "$ONLY_AFFINITY" ] && run "2 engine cores, least loaded only" --data-parallel-size 2 --no-prefix-affinity
