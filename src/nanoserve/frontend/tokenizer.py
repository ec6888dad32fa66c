"""Loads the tokenizer and chat template for a model: from a Hugging Face directory directly, or from
a GGUF file through `transformers` (slow: it rebuilds a BPE tokenizer from the GGUF vocabulary), whose
result is cached on disk keyed by the file's size and modification time."""
from __future__ import annotations

import os

from nanoserve.cache import cache_dir, file_key
from nanoserve.model.loader import ModelLoadError


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        if os.path.isdir(model_path):
            return AutoTokenizer.from_pretrained(model_path)
        cache = os.path.join(cache_dir("tokenizers"), f"{os.path.basename(model_path)}-{file_key(model_path)}")
        if os.path.isfile(os.path.join(cache, "tokenizer.json")):
            return AutoTokenizer.from_pretrained(cache)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model_path)),
                                            gguf_file=os.path.basename(model_path))
    except Exception as exc:
        raise ModelLoadError(f"{model_path}: cannot load the tokenizer ({exc})") from None
    try:
        tmp = f"{cache}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home directory only costs the next start its conversion time
    return tok
