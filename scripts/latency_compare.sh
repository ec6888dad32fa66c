#!/bin/bash
# Single-stream latency side by side, one server at a time on this machine, same GGUF: nanoserve without
# and with --speculative-ngram 4, and llama.cpp's llama-server (LLAMA_SERVER: path to the binary), each on
# random prompts and on a workload whose output repeats its prompt (`bench serve --workload copy`).
# Then concurrency 8 and 32 for nanoserve with speculation on, to show it costs batches nothing.
cd "$(dirname "$0")/.."
M=$(.venv/bin/python -c "from nanoserve.model.loader import default_model_path; print(default_model_path())")
B=".venv/bin/nanoserve bench serve --num-prompts 6"
. scripts/wait_up.sh
.venv/bin/nanoserve bench offline --skip-baseline --workloads single 2>&1 | tail -4
for spec in 0 4; do
    .venv/bin/nanoserve serve --port 8031 --speculative-ngram $spec > /tmp/bench-lat-$spec.log 2>&1 &
    wait_up http://127.0.0.1:8031/health
    $B --url http://127.0.0.1:8031 --concurrency 1 --label "nanoserve, speculation $spec, random"
    $B --url http://127.0.0.1:8031 --concurrency 1 --workload copy --label "nanoserve, speculation $spec, copy"
    if [ $spec != 0 ]; then
        .venv/bin/nanoserve bench serve --url http://127.0.0.1:8031 --concurrency 8,32 --label "nanoserve, speculation $spec, random"
    fi
    pkill -f "nanoserve serve --port 8031"; sleep 3
done
if [ -x "${LLAMA_SERVER:-}" ]; then
    "$LLAMA_SERVER" -m "$M" --port 8034 -t 2 -tb 2 -np 32 -c 16384 -cb > /tmp/bench-lat-llama.log 2>&1 &
    wait_up http://127.0.0.1:8034/health
    $B --url http://127.0.0.1:8034 --concurrency 1 --label "llama-server, random"
    $B --url http://127.0.0.1:8034 --concurrency 1 --workload copy --label "llama-server, copy"
    pkill -f "llama-server -m"; sleep 2
fi
