#!/bin/bash
# Side by side on the files people download: for each GGUF given, nanoserve and llama.cpp's llama-server
# (LLAMA_SERVER: the binary built from llama-cpp-python's vendored llama.cpp) one at a time, same file,
# 2 threads, `bench serve` at concurrency 1, 8 and 32, then the whole server's resident memory (every
# process of it). The KV caches are sized alike: llama-server -c 16384 (f16), nanoserve 0.36 GiB (f16).
# Usage: LLAMA_SERVER=... scripts/files_compare.sh FILE.gguf... (prints one JSON line per level).
cd "$(dirname "$0")/.."
OUTPUT_LEN=${OUTPUT_LEN:-64}
. scripts/wait_up.sh
tree_rss_mib() {  # resident memory of a process and all its descendants
    ps -e -o pid=,ppid=,rss= | awk -v root="$1" '{p[$1]=$2; r[$1]=$3} END {
        for (x in p) { y=x; while (y && y != root) y=p[y]; if (y == root) s += r[x] } printf "%.0f", s/1024 }'
}
for M in "$@"; do
    name=$(basename "$M" .gguf)
    .venv/bin/nanoserve serve "$M" --port 8031 --kv-cache-memory 0.36 > "/tmp/files-nano-$name.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8031/health $pid
    .venv/bin/nanoserve bench serve --url http://127.0.0.1:8031 --concurrency 1,8,32 --output-len "$OUTPUT_LEN" \
        --label "nanoserve $name" --json
    sleep 3  # resident memory once the load is over (the engine hands freed heap back when it goes idle)
    echo "{\"label\": \"nanoserve $name\", \"rss_mib\": $(tree_rss_mib $pid)}"
    kill -INT $pid; wait $pid 2>/dev/null; sleep 2
    if [ -x "${LLAMA_SERVER:-}" ]; then
        "$LLAMA_SERVER" -m "$M" --port 8032 -t 2 -tb 2 -np 32 -c 16384 -cb > "/tmp/files-llama-$name.log" 2>&1 &
        pid=$!
        wait_up http://127.0.0.1:8032/health $pid
        .venv/bin/nanoserve bench serve --url http://127.0.0.1:8032 --concurrency 1,8,32 --output-len "$OUTPUT_LEN" \
            --label "llama-server $name" --json
        sleep 3
        echo "{\"label\": \"llama-server $name\", \"rss_mib\": $(tree_rss_mib $pid)}"
        kill $pid; wait $pid 2>/dev/null; sleep 2
    fi
done
