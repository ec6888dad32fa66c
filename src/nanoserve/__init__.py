"""nanoserve: a small LLM inference server with paged KV cache and continuous batching."""
from nanoserve.entrypoints.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
