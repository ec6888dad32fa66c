"""nanoserve: a small LLM inference server with paged KV cache and continuous batching."""
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline API pulls in torch and the model code; API-server processes never need it.
    if name == "LLM":
        from nanoserve.entrypoints.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from nanoserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
