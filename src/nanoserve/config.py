"""Configuration dataclasses: the model's shape (`ModelConfig`), the KV cache, the scheduler, the
root `EngineConfig` built once and handed to every component, and the HTTP server's `ServerConfig`.
Option fields own their defaults, choices and help text: the CLI flags (`add_option_args`) and the
`LLM(...)` keyword arguments (`EngineConfig.from_kwargs`) are derived from them, as vLLM's EngineArgs
does."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

WEIGHT_DTYPES = ("auto", "float32", "float16", "bfloat16")
# --quantization: "none", or a type kernels/quant.py quantizes float matrices to on load
QUANTIZATIONS = ("none", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "q3_k", "q2_k")
ACTIVATION_DTYPES = ("auto", "float32", "int8")
KV_CACHE_DTYPES = ("auto", "float32", "float16")
KERNEL_CHOICES = ("auto", "c", "torch")
KERNEL_TARGETS = ("auto", "x86-64-v3", "portable")  # kernels.build.TARGETS, by name
LOGPROBS_MODES = ("raw", "processed")


def option(default: Any = None, help: str = "", *, choices: Optional[tuple] = None, flag: Optional[str] = None,
           cli_unit: Optional[tuple[str, int]] = None, default_factory=None):
    """A config field that is also an engine option. `flag`: the CLI spelling when it is not the
    field's name; `cli_unit` (name, factor): the CLI takes the value in that unit (GiB for bytes)."""
    meta = {"help": help, "choices": choices, "flag": flag, "cli_unit": cli_unit}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def default_kernels() -> str:
    """The default of `kernels`: NANOSERVE_KERNELS, or "torch" under NANOSERVE_NO_KERNELS=1, else auto."""
    if os.environ.get("NANOSERVE_NO_KERNELS", "") not in ("", "0"):
        return "torch"
    return os.environ.get("NANOSERVE_KERNELS") or "auto"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; filled from a GGUF header or a Hugging Face config.json."""
    architecture: str  # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Optional[dict] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV-cache block")
    num_kv_blocks: Optional[int] = option(None, "a fixed number of KV blocks (overrides --kv-cache-memory)")
    kv_cache_memory: int = option(2 << 30, "KV cache budget", cli_unit=("GiB", 1 << 30))
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of earlier prompts' common prefixes",
                                         flag="--no-prefix-caching")
    kv_cache_dtype: str = option(
        "auto", "KV cache precision: float16 halves its memory and the bytes each decode step reads "
        "(llama.cpp's default cache type); auto: float16 where head_dim is a multiple of 8, else float32",
        choices=KV_CACHE_DTYPES)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = option(2048, "token budget of one engine step (chunked prefill beyond it)")
    max_num_seqs: int = option(128, "requests running at once")
    max_model_len: int = option(0, "context length served (0: the model's own)")
    speculative_ngram: int = option(0, "speculative decoding: draft up to K tokens per step from each request's own "
                                       "prompt and output (n-gram lookup) and verify them in one step; greedy text "
                                       "and seeded samples stay the same (0: off)")
    speculative_max_rows: int = option(8, "drafts only while a step's decode rows (each running request's token and "
                                          "its drafts) fit in this many: a step of few rows costs little more than "
                                          "one, a large batch is compute-bound and drafts only add to it")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # path to a .gguf file or a Hugging Face model directory
    dtype: str = option("auto", "weight matrices: auto = as stored in the file (GGUF blocks, 16-bit or float32 "
                        "tensors); float32 / float16 / bfloat16 = every matrix converted to that type",
                        choices=WEIGHT_DTYPES)
    quantization: str = option("none", "quantize the float (F32/F16/BF16) weight matrices on load to this GGUF "
                               "block type (cached on disk; a K type falls back as llama-quantize does, q4_k -> q5_0, q5_k -> q5_1, "
                               "q6_k -> q8_0, for rows that are not a multiple of 256); block-type matrices keep "
                               "their type",
                               choices=QUANTIZATIONS)
    activation_dtype: str = option(
        "auto", "int8: quantize activations to 8 bits per block of 32 before every product on block-type "
        "weights, as llama.cpp does (faster; ~0.5%% error per product); float32: exact; auto: int8 for a model "
        "with block-type matrices (a quantized GGUF), else float32", choices=ACTIVATION_DTYPES)
    kernels: str = option(
        help="compute backend: c = the C kernels (fails at start where they cannot build or run); torch = "
        "PyTorch only; auto = c where it runs, else torch (env: NANOSERVE_KERNELS, NANOSERVE_NO_KERNELS=1)",
        choices=KERNEL_CHOICES, default_factory=default_kernels)
    kernel_target: str = option(
        help="build of the C kernels: x86-64-v3 (AVX2 vector code) or portable (the same sources in plain C, "
        "for any CPU; slower); auto: the fastest this CPU runs (env: NANOSERVE_KERNEL_TARGET)",
        choices=KERNEL_TARGETS, default_factory=lambda: os.environ.get("NANOSERVE_KERNEL_TARGET") or "auto")
    seed: int = option(0, "engine seed (unseeded requests' noise)")
    num_threads: Optional[int] = option(None, "compute threads for PyTorch and the C kernels (default: every core)")
    logprobs_mode: str = option("raw", "raw: logprobs of the model's distribution; processed: of the one sampled "
                                "from (after penalties, temperature, min_p, top-k/top-p)", choices=LOGPROBS_MODES)
    max_logprobs: int = option(20, "cap on logprobs / prompt_logprobs per request")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Builds the config from flat option names (`block_size=32, seed=1`); TypeError on an unknown one."""
        parts: dict[str, dict] = {"cache": {}, "scheduler": {}, "": {}}
        owner = {f.name: key for key, c in (("", cls), ("cache", CacheConfig), ("scheduler", SchedulerConfig))
                 for f in option_fields(c)}
        for name, value in kwargs.items():
            if name not in owner:
                raise TypeError(f"unknown engine option {name!r} (options: {', '.join(sorted(owner))})")
            parts[owner[name]][name] = value
        return cls(model=model, cache=CacheConfig(**parts["cache"]),
                   scheduler=SchedulerConfig(**parts["scheduler"]), **parts[""])


@dataclass
class ServerConfig:
    """`nanoserve serve`'s HTTP side; the launcher fills `model_path`, `engine_addresses` and each API
    server's `index`."""
    model_path: str = ""
    engine_addresses: list[str] = field(default_factory=list)  # each engine core's ZMQ address
    index: int = 0
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_server_count: int = option(1, "API-server processes sharing the port")
    data_parallel_size: int = option(1, "engine-core processes, each with its own weights, KV cache and CPUs; "
                                        "requests are routed to the least loaded, with prefix affinity")
    cpus_per_engine: int = option(0, "CPUs each engine core is pinned to (0: with --data-parallel-size > 1, "
                                     "the CPUs this process may use split evenly; with 1, not pinned)")
    prefix_affinity: bool = option(True, "with --data-parallel-size > 1, route a prompt to the engine that "
                                         "was sent its first blocks (its prefix cache); off: least loaded only",
                                   flag="--no-prefix-affinity")
    api_keys: list[str] = option(help="required bearer key on every route but /health and /metrics "
                                      "(repeatable; or NANOSERVE_API_KEY)",
                                 flag="--api-key", default_factory=list)
    served_model_names: list[str] = option(help="model name(s) clients use (repeatable; default: the file's "
                                           "name)", flag="--served-model-name", default_factory=list)
    reasoning_parser: Optional[str] = option(None, "qwen3 or deepseek_r1: reasoning text to its own field")
    chat_template: Optional[str] = option(None, "the chat template: a file, the template text, or chatml-tools "
                                                "(shipped: ChatML with Hermes tool calls); default: the model's")
    tool_call_parser: Optional[str] = option(None, "hermes, llama3_json, mistral or pythonic: tool calls the "
                                                   "model writes become tool_calls (tool_choice auto, the "
                                                   "default with tools)")
    max_waiting_requests: int = option(0, "503 beyond this many waiting requests (0: no limit)")
    allowed_origins: list[str] = option(help="CORS origin (repeatable, '*' for any)", default_factory=list)
    drain_timeout: float = option(30.0, "seconds SIGTERM waits for in-flight requests")
    log_level: str = option("info", "log level", choices=("debug", "info", "warning", "error"))
    max_body_bytes: int = option(32 * 2**20, "413 for a request body larger than this")
    max_json_nodes: int = option(1 << 17, "413 for a body (over 1 MiB) with more JSON nodes than this, counted "
                                          "before parsing: each '{', '[' and ':' as one, each ',' as 1/16")
    max_header_bytes: int = option(32 * 2**10, "431 for request headers larger than this, all together")
    max_headers: int = option(100, "431 for more request headers than this")
    max_request_id_length: int = option(128, "431 for a longer X-Request-Id (it is echoed back)")
    body_read_timeout: float = option(30.0, "408 when a request body takes longer than this many seconds to arrive")
    keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive connection stays open")
    enable_docs: bool = option(False, "serve the interactive API docs at /docs (behind the API key, like every "
                                      "route but /health and /metrics)")
    trust_request_chat_template: bool = option(False, "let requests bring their own chat template (it runs on "
                                                      "the server; refused by default)")
    chat_template_timeout: float = option(5.0, "400 when rendering a request's chat template takes longer than "
                                               "this many seconds (the rendering is stopped)")


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


ENGINE_OPTION_CLASSES = (EngineConfig, CacheConfig, SchedulerConfig)
_CLI_TYPES = {"int": int, "Optional[int]": int, "float": float}


def add_option_args(parser: argparse.ArgumentParser, classes=ENGINE_OPTION_CLASSES) -> None:
    """One flag per option field of `classes`, with the dataclass's default shown in its help."""
    for cls in classes:
        for f in option_fields(cls):
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):  # a default-on switch turned off by its flag
                parser.add_argument(flag, dest=f.name, action="store_const", const=not default, default=None,
                                    help=meta["help"])
                continue
            if str(f.type).startswith("list"):
                parser.add_argument(flag, dest=f.name, action="append", default=None, help=meta["help"])
                continue
            kind, shown = _CLI_TYPES.get(f.type, str), default
            if meta["cli_unit"]:
                unit, factor = meta["cli_unit"]
                kind, shown = float, f"{default / factor:g} {unit}"
            suffix = "" if default is None else f" (default: {shown})"  # a None default is said in the help
            parser.add_argument(flag, dest=f.name, type=kind, default=None, choices=meta["choices"],
                                help=meta["help"] + suffix)


def kwargs_from_args(args: argparse.Namespace, classes=ENGINE_OPTION_CLASSES) -> dict:
    """The options given on the command line (unset flags keep the dataclass defaults)."""
    out = {}
    for cls in classes:
        for f in option_fields(cls):
            value = getattr(args, f.name, None)
            if value is None:
                continue
            unit = f.metadata["cli_unit"]
            out[f.name] = int(value * unit[1]) if unit else value
    return out
