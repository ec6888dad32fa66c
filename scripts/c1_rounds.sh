#!/bin/bash
# Concurrency 1, alternated rounds: the offline batch-1 step, nanoserve serve (defaults) and llama-server
# (LLAMA_SERVER: path to the binary), 8 prompts each, one JSON line per server and round.
cd "$(dirname "$0")/.."
M=$(.venv/bin/python -c "from nanoserve.model.loader import default_model_path; print(default_model_path())")
B=".venv/bin/nanoserve bench serve --num-prompts 8 --concurrency 1"
. scripts/wait_up.sh
for round in $(seq ${ROUNDS:-3}); do
  .venv/bin/nanoserve bench offline --skip-baseline --workloads single 2>&1 | grep "batch-1"
  .venv/bin/nanoserve serve --port 8031 > /tmp/c1-nano.log 2>&1 &
  wait_up http://127.0.0.1:8031/health
  $B --url http://127.0.0.1:8031 --label "nanoserve" --json | tail -1
  pkill -f "nanoserve serve --port 8031"; sleep 3
  "$LLAMA_SERVER" -m "$M" --port 8034 -t 2 -tb 2 -np 32 -c 16384 -cb > /tmp/c1-llama.log 2>&1 &
  wait_up http://127.0.0.1:8034/health
  $B --url http://127.0.0.1:8034 --label "llama-server" --json | tail -1
  pkill -f "llama-server -m"; sleep 2
done
