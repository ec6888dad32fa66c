"""Benchmark commands (`nanoserve bench ...`): each measures nanoserve against a baseline side by side in one run."""
