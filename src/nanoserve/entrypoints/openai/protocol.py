"""Pydantic models of the OpenAI-compatible requests (completions, chat, tokenize, detokenize) with
the vLLM extras clients send in `extra_body`; unknown fields are ignored. `to_sampling_params` maps a
request onto `SamplingParams`, whose own checks name the offending field."""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.sampling_params import SamplingParams


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


MAX_N = 128  # completions per request, OpenAI's own limit: each one holds a sequence in the engine


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extras)."""
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: list[str] = Field(default_factory=list)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    return_token_ids: bool = False
    prompt_logprobs: Optional[int] = None

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        default_max_tokens: Optional[int]) -> SamplingParams:
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids, got "
                                 f"{list(self.logit_bias)!r}") from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            stop=stop, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (how evaluation harnesses score a prompt): the engine generates one
        token, which the response leaves out."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(1 if self.prompt_only else self.max_tokens, self.logprobs, 16)


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict[str, Any]]] = None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, None)


class TokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


