"""Pydantic models of the OpenAI-compatible requests (completions, chat, tokenize, detokenize) with
the vLLM extras clients send in `extra_body`; unknown fields are ignored. `to_sampling_params` maps a
request onto `SamplingParams`, whose own checks name the offending field."""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from nanoserve.sampling_params import MAX_STOP_STRINGS, SamplingParams
from nanoserve.structured import StructuredOutputs


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


MAX_N = 128  # completions per request, OpenAI's own limit: each one holds a sequence in the engine
INT64_MAX = 2**63 - 1
# Every integer a request carries fits the engine's 64-bit fields (a larger one is a 400 naming the field,
# not an overflow deep in the server); token ids are also never negative.
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
MAX_MESSAGES = 4096  # a million empty messages (a 32 MiB body) held the event loop 5 s in validation
MAX_TOOLS = 128  # OpenAI's limit
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's older spellings -> StructuredOutputs kinds
MAX_PROMPT_TOKEN_IDS = 1 << 20  # in all the prompts of one request; 11M (32 MiB) took 10 s to validate
MAX_PROMPTS = 4096  # prompts in one completions request


def at_most(limit: int):
    """A list refused by its length before its items are validated (pydantic's max_length checks after)."""
    def check(value):
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} items are accepted, got {len(value)}")
        return value
    return BeforeValidator(check)


def check_token_prompt(value: Any) -> Any:
    """At most MAX_PROMPTS prompts; token ids (a list, or a list of lists) at most MAX_PROMPT_TOKEN_IDS in all, each
    in [0, 2^63). Checked before the prompt's form is validated, so the error names the id (min and max run
    at C speed; a list that is not all numbers is left to the form's own error)."""
    if isinstance(value, list) and len(value) > MAX_PROMPTS and value and isinstance(value[0], (str, list)):
        raise ValueError(f"at most {MAX_PROMPTS} prompts are accepted in one request, got {len(value)}")
    lists = value if isinstance(value, list) and value and isinstance(value[0], list) else [value]
    if sum(len(ids) for ids in lists if isinstance(ids, list) and ids and not isinstance(ids[0], str)) \
            > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"prompts of more than {MAX_PROMPT_TOKEN_IDS} token ids in all are not accepted")
    for ids in lists:
        if isinstance(ids, list) and ids and not isinstance(ids[0], str):
            try:
                bounds = (min(ids), max(ids))
            except TypeError:
                continue
            for t in bounds:
                if isinstance(t, int) and not 0 <= t <= INT64_MAX:
                    raise ValueError(f"prompt token ids must be non-negative 64-bit integers, got {t}")
    return value


def prompt_form(value: Any) -> Optional[str]:
    """Which of the prompt's forms a value is, from its first item: the union is validated as that form
    only (pydantic's smart union tried every form on every item: 10M ids took 9 s instead of 0.5)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else ""
        return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"
    return None


Prompt = Annotated[Union[Annotated[str, Tag("text")], Annotated[list[str], Tag("texts")],
                         Annotated[list[TokenId], Tag("ids")], Annotated[list[list[TokenId]], Tag("id_lists")]],
                   Discriminator(prompt_form, custom_error_type="prompt_form",
                                 custom_error_message="prompt must be a string, a list of strings, a list of token "
                                                      "ids or a list of lists of token ids")]


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extras)."""
    model: Optional[str] = None
    n: Int64 = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    seed: Optional[Int64] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[TokenId]] = None
    bad_words: list[str] = Field(default_factory=list)
    stop: Annotated[Optional[Union[str, list[str]]], at_most(MAX_STOP_STRINGS)] = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    return_token_ids: bool = False
    prompt_logprobs: Optional[Int64] = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None

    def structured_field(self) -> Optional[str]:
        """The request field that asks for structured outputs (errors found by the engine name it)."""
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format"
        return next((name for name in ("structured_outputs", *GUIDED_FIELDS) if getattr(self, name) is not None), None)

    def structured_spec(self) -> Optional[StructuredOutputs]:
        """The one structured-outputs request among the fields, with the checks that need no grammar engine
        (a ValueError names the field: a malformed spec, or two fields at once). The engine compiles it: an
        invalid schema, regex or grammar is its 400, before any stream starts."""
        given = {}
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            kind = fmt.get("type")
            if kind == "json_object":
                given["response_format"] = StructuredOutputs(json_object=True)
            elif kind == "json_schema":
                schema = (fmt.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise ValueError("response_format: json_schema.schema must be a JSON schema object")
                given["response_format"] = StructuredOutputs(json=schema)
            else:
                raise ValueError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")
        if self.structured_outputs is not None:
            try:
                given["structured_outputs"] = msgspec.convert(self.structured_outputs, StructuredOutputs)
            except msgspec.ValidationError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        for name, key in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                given[name] = StructuredOutputs(**{key: value}, whitespace_pattern=self.guided_whitespace_pattern)
        if len(given) > 1:
            raise ValueError(f"{next(iter(given))}: only one structured-outputs field at a time, got "
                             f"{', '.join(given)}")
        if not given:
            return None
        (name, spec), = given.items()
        try:
            spec.kind()
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return spec

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
            bad = next((k for k in bias if not 0 <= k <= INT64_MAX), None)
            if bad is not None:
                raise ValueError(f"logit_bias keys must be non-negative 64-bit token ids, got {bad}")
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
            skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured_spec(),
            spaces_between_special_tokens=self.spaces_between_special_tokens)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Optional[Int64] = 16
    logprobs: Optional[Int64] = None
    echo: bool = False
    suffix: Optional[str] = None

    _check_prompt = field_validator("prompt", mode="before")(check_token_prompt)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (how evaluation harnesses score a prompt): the engine generates one
        token, which the response leaves out."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(1 if self.prompt_only else self.max_tokens, self.logprobs, 16)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TEXT_PART_TYPES = ("text", "input_text")


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Annotated[Optional[Union[str, list[dict[str, Any]]]], at_most(MAX_MESSAGES)] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        """The models served are text-only: an image or audio part is refused, not silently dropped."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if kind not in TEXT_PART_TYPES:
                raise ValueError(f"content parts of type {kind!r} are not supported: this model takes text only "
                                 f"(parts of type {' or '.join(TEXT_PART_TYPES)})")
        return content

    @model_validator(mode="after")
    def _tool_result_names_its_call(self):
        if self.role == "tool" and not (self.model_extra or {}).get("tool_call_id"):
            raise ValueError("a message with role 'tool' needs the tool_call_id of the call it answers")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], at_most(MAX_MESSAGES)]
    max_tokens: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    logprobs: bool = False
    top_logprobs: Optional[Int64] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[Optional[list[dict[str, Any]]], at_most(MAX_TOOLS)] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None

    def structured_field(self) -> Optional[str]:
        field = super().structured_field()
        if field is None and self.tools and self.tool_choice != "none":
            return "tools"  # the tools' parameter schemas became the constraint
        return field

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, None)


class TokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Annotated[Optional[list[ChatMessage]], at_most(MAX_MESSAGES)] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[TokenId]


