#!/bin/bash
# Side-by-side serving benchmark: nanoserve (defaults, with 1 and 2 API servers; with llama.cpp's
# numerics, int8 activations; with an exact float32 KV cache), llama-cpp-python's server and
# llama.cpp's llama-server, one at a time on this machine, same GGUF, same load. Optional, both kept outside this repository:
# LLAMA_CPP_PYTHON, the python of a venv with llama-cpp-python[server]; LLAMA_SERVER, the llama-server
# binary built from that package's vendored llama.cpp.
cd "$(dirname "$0")/.."
M=$(.venv/bin/python -c "from nanoserve.model.loader import default_model_path; print(default_model_path())")
. scripts/wait_up.sh
.venv/bin/nanoserve serve --port 8021 > /tmp/bench-nano.log 2>&1 &
wait_up http://127.0.0.1:8021/health
.venv/bin/nanoserve bench serve --url http://127.0.0.1:8021 --concurrency 1,8,32 --label "nanoserve (1 API server)"
pkill -f "nanoserve serve --port 8021"; sleep 3
.venv/bin/nanoserve serve --port 8021 --activation-dtype int8 > /tmp/bench-nano8.log 2>&1 &
wait_up http://127.0.0.1:8021/health
.venv/bin/nanoserve bench serve --url http://127.0.0.1:8021 --concurrency 1,8,32 --label "nanoserve (int8 activations)"
pkill -f "nanoserve serve --port 8021"; sleep 3
.venv/bin/nanoserve serve --port 8021 --kv-cache-dtype float32 > /tmp/bench-nano32.log 2>&1 &
wait_up http://127.0.0.1:8021/health
.venv/bin/nanoserve bench serve --url http://127.0.0.1:8021 --concurrency 32 --label "nanoserve (float32 KV cache)"
pkill -f "nanoserve serve --port 8021"; sleep 3
.venv/bin/nanoserve serve --port 8022 --api-server-count 2 > /tmp/bench-nano2.log 2>&1 &
wait_up http://127.0.0.1:8022/health
.venv/bin/nanoserve bench serve --url http://127.0.0.1:8022 --concurrency 32 --label "nanoserve (2 API servers)"
pkill -f "nanoserve serve --port 8022"; sleep 3
if [ -x "${LLAMA_CPP_PYTHON:-}" ]; then
    "$LLAMA_CPP_PYTHON" -m llama_cpp.server --model "$M" --port 8023 --n_threads 2 --n_threads_batch 2 \
        --n_ctx 4096 --interrupt_requests False > /tmp/bench-llamacpp.log 2>&1 &
    wait_up http://127.0.0.1:8023/v1/models
    .venv/bin/nanoserve bench serve --url http://127.0.0.1:8023 --concurrency 1,8,32 --label "llama-cpp-python"
    pkill -f "llama_cpp.server --model"; sleep 2
fi
# llama.cpp's own C++ server, when built (LLAMA_SERVER: path to the llama-server binary): continuous
# batching, 32 slots, 2 threads.
if [ -x "${LLAMA_SERVER:-}" ]; then
    "$LLAMA_SERVER" -m "$M" --port 8024 -t 2 -tb 2 -np 32 -c 16384 -cb > /tmp/bench-llama-server.log 2>&1 &
    wait_up http://127.0.0.1:8024/health
    .venv/bin/nanoserve bench serve --url http://127.0.0.1:8024 --concurrency 1,8,32 --label "llama-server (C++)"
    kill %% 2>/dev/null; pkill -f "llama-server -m" ; sleep 2
fi
