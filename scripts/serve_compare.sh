#!/bin/bash
# Side-by-side serving benchmark: nanoserve (1 and 2 API servers) and llama-cpp-python's server, one
# at a time on this machine, same GGUF, same load. LLAMA_CPP_PYTHON: the python of a venv with
# llama-cpp-python[server] installed (built from source; keep it outside this repository).
cd "$(dirname "$0")/.."
M=$(.venv/bin/python -c "from nanoserve.model.loader import default_model_path; print(default_model_path())")
wait_up() { for i in $(seq 120); do curl -sf "$1" >/dev/null && return 0; sleep 1; done; return 1; }
.venv/bin/nanoserve serve --port 8021 > /tmp/bench-nano.log 2>&1 &
wait_up http://127.0.0.1:8021/health
.venv/bin/nanoserve bench serve --url http://127.0.0.1:8021 --concurrency 1,8,32 --label "nanoserve (1 API server)"
pkill -f "nanoserve serve --port 8021"; sleep 3
.venv/bin/nanoserve serve --port 8022 --api-server-count 2 > /tmp/bench-nano2.log 2>&1 &
wait_up http://127.0.0.1:8022/health
.venv/bin/nanoserve bench serve --url http://127.0.0.1:8022 --concurrency 32 --label "nanoserve (2 API servers)"
pkill -f "nanoserve serve --port 8022"; sleep 3
"${LLAMA_CPP_PYTHON:-/work/llamacpp/venv/bin/python}" -m llama_cpp.server --model "$M" --port 8023 --n_threads 2 --n_threads_batch 2 \
    --n_ctx 4096 --interrupt_requests False > /tmp/bench-llamacpp.log 2>&1 &
wait_up http://127.0.0.1:8023/v1/models
.venv/bin/nanoserve bench serve --url http://127.0.0.1:8023 --concurrency 1,8,32 --label "llama-cpp-python 0.3.36"
pkill -f "llama_cpp.server --model"
