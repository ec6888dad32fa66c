#!/bin/bash
# Side by side on the files people download: for each GGUF given, nanoserve and llama.cpp's llama-server
# (LLAMA_SERVER: the binary built from llama-cpp-python's vendored llama.cpp), both up at once on the same
# file (an idle server takes no CPU), 2 threads each. ROUNDS rounds (default 2) of `bench serve` at
# concurrency 1, 8 and 32, the two servers alternated level by level (which goes first alternates by
# round), so that the host's drift (10-30% over minutes on a shared machine) falls on both alike; each
# round its own prompts (a prefix cache must not serve a repeat). After each round, the whole resident
# memory of each server (every process of it). The KV caches are sized alike: llama-server -c 16384
# (f16), nanoserve 0.36 GiB (f16).
# Usage: LLAMA_SERVER=... [ROUNDS=2] [LEVELS="1 8 32"] [C1_PROMPTS=6] scripts/files_compare.sh FILE.gguf...
# > LOG (one JSON line per server, round and level, and per server and round one with rss_mib); then
# `python scripts/files_table.py LOG` prints the table (medians over the rounds). The c=1 level runs
# C1_PROMPTS requests of OUTPUT_LEN tokens one after another (its ITL median over ~380 steps; with 2, the
# default of `bench serve`, 128 steps read a 1.1B file's step from 22.5 to 30.5 ms over five rounds);
# LEVELS=1 with more ROUNDS measures batch-1 alone.
cd "$(dirname "$0")/.."
OUTPUT_LEN=${OUTPUT_LEN:-64}
ROUNDS=${ROUNDS:-2}
LEVELS=${LEVELS:-1 8 32}
C1_PROMPTS=${C1_PROMPTS:-6}
# An even count: which server runs first alternates by round, so that any effect of the order falls on
# both alike (in a 3-round run on the 1.1B Q4_K_M, whichever server ran first read a c=1 decode step
# 2-7 ms longer than when it ran second; nanoserve ran first twice and its median took that).
[ $((ROUNDS % 2)) = 0 ] || { echo "$0: ROUNDS must be even (each server first in as many rounds)" >&2; exit 1; }
[ -x "${LLAMA_SERVER:-}" ] || { echo "$0: set LLAMA_SERVER to llama.cpp's llama-server binary" >&2; exit 1; }
. scripts/wait_up.sh
tree_rss_mib() {  # resident memory of a process and all its descendants
    ps -e -o pid=,ppid=,rss= | awk -v root="$1" '{p[$1]=$2; r[$1]=$3} END {
        for (x in p) { y=x; while (y && y != root) y=p[y]; if (y == root) s += r[x] } printf "%.0f", s/1024 }'
}
# bench SERVER PORT ROUND LEVEL NAME: the same prompts for both servers, new ones each round and level; C1_PROMPTS
# requests at c=1, else bench serve's own count (--num-prompts 0: 2 x concurrency)
bench() {
    .venv/bin/nanoserve bench serve --url "http://127.0.0.1:$2" --concurrency "$4" --output-len "$OUTPUT_LEN" \
        --num-prompts "$([ "$4" = 1 ] && echo "$C1_PROMPTS" || echo 0)" \
        --seed $((100 * $3 + $4)) --warmup "$([ "$4" = 1 ] && echo 2 || echo 0)" --label "$1 $5" --json |
        sed "s/^{/{\"round\": $3, /"
}
for M in "$@"; do
    name=$(basename "$M" .gguf)
    .venv/bin/nanoserve serve "$M" --port 8031 --kv-cache-memory 0.36 > "/tmp/files-nano-$name.log" 2>&1 &
    nano=$!
    wait_up http://127.0.0.1:8031/health $nano
    "$LLAMA_SERVER" -m "$M" --port 8032 -t 2 -tb 2 -np 32 -c 16384 -cb > "/tmp/files-llama-$name.log" 2>&1 &
    llama=$!
    wait_up http://127.0.0.1:8032/health $llama
    for round in $(seq "$ROUNDS"); do
        for level in $LEVELS; do
            if [ $((round % 2)) = 1 ]; then
                bench nanoserve 8031 "$round" $level "$name"; bench llama-server 8032 "$round" $level "$name"
            else
                bench llama-server 8032 "$round" $level "$name"; bench nanoserve 8031 "$round" $level "$name"
            fi
        done
        # resident memory once the round's load is over (the engine hands freed heap back when it goes
        # idle); llama-server's grows round by round with its prompt cache in RAM (--cache-ram, 8 GiB)
        sleep 3
        echo "{\"round\": $round, \"label\": \"nanoserve $name\", \"rss_mib\": $(tree_rss_mib $nano)}"
        echo "{\"round\": $round, \"label\": \"llama-server $name\", \"rss_mib\": $(tree_rss_mib $llama)}"
    done
    kill -INT $nano; kill $llama; wait $nano $llama 2>/dev/null; sleep 2
done
