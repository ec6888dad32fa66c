"""The on-disk cache for things that are slow to rebuild at every start (a GGUF file's converted
tokenizer and dequantized weights, compiled kernels): `~/.cache/nanoserve`, or `$NANOSERVE_CACHE`."""
from __future__ import annotations

import hashlib
import os


def cache_dir(kind: str) -> str:
    root = os.environ.get("NANOSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanoserve")
    return os.path.join(root, kind)


def file_key(path: str, salt: str = "") -> str:
    """Changes when the file (path, size, modification time) or the salt changes."""
    st = os.stat(path)
    text = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{salt}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
