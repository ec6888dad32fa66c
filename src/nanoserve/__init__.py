"""nanoserve: a small LLM inference server."""
