"""Offline API: `LLM(model).generate(prompts, params)` runs an in-process `EngineCore` until every
prompt is done, with a tqdm progress bar, and returns vLLM-shaped `RequestOutput`s in prompt order."""
from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence, Union

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine.core import EngineCore
from nanoserve.frontend.output_processor import OutputProcessor
from nanoserve.frontend.tokenizer import engine_requests, load_tokenizer
from nanoserve.model.loader import default_model_path
from nanoserve.outputs import CompletionOutput, Logprob, RequestOutput
from nanoserve.protocol import TokenLogprobs
from nanoserve.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]


def logprob_entry(token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
    """vLLM's shape: {token id: Logprob} for the top-N alternatives and the chosen token."""
    entry = {t: Logprob(v, rank) for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1)}
    entry[token] = Logprob(lp.logprob, lp.rank)
    return entry


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_args):
        """`engine_args`: any engine option by its field name in nanoserve.config (the same options as
        the CLI's flags, with the same defaults), e.g. `LLM(path, dtype="q4", kv_cache_dtype="float32")`."""
        self.model_path = model or default_model_path()
        self.config = EngineConfig.from_kwargs(self.model_path, **engine_args)
        self.engine = EngineCore(self.config)  # first: its errors name the model file most clearly
        self.tokenizer = load_tokenizer(self.model_path)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------------------ generate
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")

        results: list[RequestOutput] = []
        processor = OutputProcessor(self.tokenizer)
        pending: list[str] = []
        for (text, ids), params in zip(prompts, sampling_params):
            request_id = str(next(self._ids))
            result = RequestOutput(request_id, text, ids)
            results.append(result)
            for k, child in enumerate(engine_requests(self.tokenizer, request_id, ids, params)):
                try:
                    self.engine.add_request(child)
                except Exception:
                    for other in pending:  # leave the engine as we found it
                        self.engine.abort(other)
                    raise
                pending.append(child.request_id)
                result.outputs.append(CompletionOutput(k, "", []))
                processor.add_request(child.request_id, request_id, k, params)
        self._run(processor, {r.request_id: r for r in results}, use_tqdm)
        for result in results:
            for out in result.outputs:
                for entry in out.logprobs or ():
                    for token, lp in entry.items():
                        lp.decoded_token = self.tokenizer.decode([token])
            for entry in result.prompt_logprobs or ():
                for token, lp in (entry or {}).items():
                    lp.decoded_token = self.tokenizer.decode([token])
        return results

    def _run(self, processor: OutputProcessor, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=len(results), desc="Generating", unit="prompt", disable=not use_tqdm,
                   dynamic_ncols=True)
        start, num_out = time.perf_counter(), 0
        remaining = {rid: len(r.outputs) for rid, r in results.items()}
        while self.engine.has_unfinished():
            deltas, to_abort = processor.process(self.engine.step())
            for child_id in to_abort:  # a stop string ended it: free its blocks now
                self.engine.abort(child_id)
            for delta in deltas:
                result = results[delta.request_id]
                completion = result.outputs[delta.index]
                completion.text += delta.text
                completion.token_ids.extend(delta.token_ids)
                if delta.prompt_logprobs is not None and result.prompt_logprobs is None:
                    result.prompt_logprobs = [None] + [
                        logprob_entry(t, lp) for t, lp in zip(result.prompt_token_ids[1:], delta.prompt_logprobs)]
                for token, lp in zip(delta.token_ids, delta.logprobs or ()):
                    if completion.logprobs is None:
                        completion.logprobs, completion.cumulative_logprob = [], 0.0
                    completion.logprobs.append(logprob_entry(token, lp))
                    completion.cumulative_logprob += lp.logprob
                num_out += len(delta.token_ids)
                result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
                    remaining[delta.request_id] -= 1
                    if remaining[delta.request_id] == 0:
                        result.finished = True
                        bar.update(1)
            if use_tqdm:
                bar.set_postfix_str(f"output {num_out / (time.perf_counter() - start):.1f} tok/s", refresh=False)
        bar.close()

    def _normalize_prompts(self, prompts) -> list[tuple[Optional[str], list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        normalized = []
        for p in prompts:
            if isinstance(p, str):
                normalized.append((p, self.tokenizer.encode(p, add_special_tokens=True)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                normalized.append((p.get("prompt"), list(p["prompt_token_ids"])))
            elif isinstance(p, dict) and "prompt" in p:
                normalized.append((p["prompt"], self.tokenizer.encode(p["prompt"], add_special_tokens=True)))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                normalized.append((None, list(p)))
            else:
                raise TypeError(f"unsupported prompt {p!r}: use a string, a list of token ids, or "
                                "a dict with 'prompt' or 'prompt_token_ids'")
        return normalized

    # ---------------------------------------------------------------------------------- chat
    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}))
            # The template already holds any BOS token; do not add special tokens twice.
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)
