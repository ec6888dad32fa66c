"""Loads the tokenizer and chat template for a model: from a Hugging Face directory directly, or from
a GGUF file through `transformers` (slow: it rebuilds a BPE tokenizer from the GGUF vocabulary), whose
result is cached on disk keyed by the file's size and modification time. Also turns bad words into the
token sequences the engine bans."""
from __future__ import annotations

import os
import time

import msgspec

from nanoserve.cache import cache_dir, file_key
from nanoserve.errors import ModelLoadError
from nanoserve.protocol import EngineCoreRequest


def load_tokenizer(model_path: str):
    try:
        cache = os.path.join(cache_dir("tokenizers"), f"{os.path.basename(model_path)}-{file_key(model_path)}")
        if not os.path.isdir(model_path) and os.path.isfile(os.path.join(cache, "tokenizer.json")):
            # NOTE: our converted GGUF tokenizer is always a fast tokenizer. Loading it by its class
            # skips AutoTokenizer, whose config machinery imports torch: ~300 MB and ~2 s of start-up
            # in every API-server process, which never runs a tensor op.
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(cache)
        from transformers import AutoTokenizer

        if os.path.isdir(model_path):
            return AutoTokenizer.from_pretrained(model_path)
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


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as token sequences, both as written at the start of the text and after a space
    (BPE tokenizers spell the two differently), without duplicates."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def engine_requests(tokenizer, request_id: str, prompt_token_ids: list[int], params) -> list[EngineCoreRequest]:
    """What the engine core gets for one user request: bad words turned into token ids, text fields
    removed, and `n > 1` fanned out into n requests `{id}-{k}` sharing the parent id (with a seed,
    sample k uses seed + k). Used by both the offline `LLM` and the API servers."""
    if params.bad_words:
        params = msgspec.structs.replace(
            params, bad_words_token_ids=params.bad_words_token_ids + bad_words_token_ids(tokenizer, params.bad_words))
    params = params.for_engine()
    now = time.monotonic()
    if params.n == 1:
        return [EngineCoreRequest(request_id, prompt_token_ids, params, now)]
    return [EngineCoreRequest(f"{request_id}-{k}", prompt_token_ids, msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + k), now, request_id)
            for k in range(params.n)]
