"""The two generation endpoints: a validated request becomes prompts and `SamplingParams`, goes to
the engine through `AsyncLLM`, and comes back as an OpenAI-shaped JSON body or an SSE stream
(`data: {...}` chunks, usage, `data: [DONE]`). Also the OpenAI error shape and logprob formatting."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanoserve.entrypoints.openai.deadline import DeadlineExceeded, run_with_deadline
from nanoserve.entrypoints.openai.metrics import Metrics, RequestTimer
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.entrypoints.openai.tools import ToolRequest, tool_calls_message
from nanoserve.engine.client import EngineDeadError, RequestRejected
from nanoserve.frontend.async_llm import AsyncLLM, RequestStream
from nanoserve.frontend.output_processor import CompletionDelta
from nanoserve.frontend.reasoning import make_reasoning_parser
from nanoserve.protocol import TokenLogprobs
from nanoserve.structured import STRUCTURED_KINDS
from nanoserve.templates import renders_tools


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type: str, param: Optional[str] = None,
                   code: Optional[str] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code or status}},
                        status_code=status)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Choice:
    """What one completion has produced so far."""

    def __init__(self, index: int, prefix: str = ""):
        self.index = index
        self.text = prefix
        self.reasoning = ""
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, TokenLogprobs]] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.prompt_logprobs: Optional[list[TokenLogprobs]] = None

    def add(self, delta: CompletionDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.reasoning += delta.reasoning
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += list(zip(delta.token_ids, delta.logprobs))
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


DRAIN_EXPIRED = "the server is shutting down and this request did not finish within its drain time (--drain-timeout)"
OFF_LOOP_CHARS = 16384  # inputs longer than this are tokenized on a worker thread


def text_chars(prompt) -> int:
    """Characters of text in a completion prompt (strings only; token ids are not text)."""
    items = [prompt] if isinstance(prompt, str) else prompt
    return sum(len(item) for item in items if isinstance(item, str))


def messages_chars(messages) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else
               sum(len(str(part.get("text", ""))) for part in m.content or ()) for m in messages)


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, tokenizer, model_names: list[str], metrics: Metrics,
                 reasoning_parser: Optional[str] = None, trust_request_chat_template: bool = False,
                 chat_template_timeout: float = 5.0, tool_call_parser: Optional[str] = None):
        self.llm, self.tokenizer, self.model_names = llm, tokenizer, model_names
        self.tool_call_parser = tool_call_parser
        self.template_renders_tools = renders_tools(tokenizer.chat_template or "")
        self.metrics, self.reasoning_parser = metrics, reasoning_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template_timeout = chat_template_timeout
        self.drain_expired = False  # set just before a shutdown's drain time runs out (end_drain)
        # No token spans more characters than the vocabulary's longest, so a text longer than
        # max_model_len of those cannot fit: refused before it is tokenized (set_max_model_len).
        self.longest_token_chars = max((len(t) for t in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
                                        if t), default=1)
        self.max_prompt_chars: Optional[int] = None

    def end_drain(self) -> None:
        """The server is stopping and its drain time is nearly over: every request still running ends now,
        a stream with an error event and `[DONE]`, a non-streaming request with a 503."""
        self.drain_expired = True

    def set_max_model_len(self, max_model_len: int) -> None:
        self.max_prompt_chars = max_model_len * self.longest_token_chars

    def check_text_length(self, chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(400, f"{param} is {chars} characters long, more than this model's context can hold "
                           f"({self.max_prompt_chars} characters fit in any case)", param=param)

    @staticmethod
    async def tokenize_off_loop(fn, chars: int, *args):
        """Tokenizing (or templating) a large input runs on a worker thread, so that the event loop keeps
        answering everyone else (a 20 MB prompt held it, and /health, for 11 s); a small one runs here,
        without the thread hop."""
        if chars > OFF_LOOP_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    # --------------------------------------------------------------------------- shared parts
    def check_model(self, model: Optional[str]) -> str:
        if model and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")
        return model or self.model_names[0]

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    async def _submit(self, raw: Request, req, prompts: list[list[int]], params, reasoning_for) -> list[RequestStream]:
        """Submits every prompt; if one is refused, the others are withdrawn and the error raised (a grammar
        the engine could not compile names the request's structured-outputs field)."""
        base = raw.headers.get("x-request-id") or uuid.uuid4().hex
        streams = []
        try:
            for i, ids in enumerate(prompts):
                request_id = f"{base}-{i}-{uuid.uuid4().hex[:8]}"
                streams.append(await self.llm.submit(request_id, ids, params, reasoning_for(i)))
        except RequestRejected as exc:
            for s in streams:
                s.abort()
            field = req.structured_field()
            if exc.status == 400 and field is not None and exc.param in STRUCTURED_KINDS:
                raise APIError(400, f"{field}: {exc}", param=field) from None
            raise
        except BaseException:
            for s in streams:
                s.abort()
            raise
        for ids in prompts:
            self.metrics.prompt_tokens.inc(len(ids))
        return streams

    async def _merge(self, streams: list[RequestStream], n: int, timer: RequestTimer
                     ) -> AsyncIterator[tuple[int, CompletionDelta]]:
        """Deltas of every prompt's completions as they come, with their global choice index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, stream: RequestStream):
            try:
                async for delta in stream:
                    await queue.put((p * n + delta.index, delta))
                await queue.put(None)
            except Exception as exc:
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
        reasons = []
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                timer.tokens(len(item[1].token_ids))
                if item[1].finished:
                    reasons.append(item[1].finish_reason)
                yield item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()  # no-op for finished ones; a client that left frees its blocks
            timer.finish(reasons + ["abort"] * (len(streams) * n - len(reasons)))

    async def _collect(self, raw: Request, streams, n: int, choices: list[Choice], timer) -> list[int]:
        """Runs a non-streaming request to the end, aborting it if the client disconnects."""
        cached = [0] * len(streams)

        async def run():
            async for index, delta in self._merge(streams, n, timer):
                choices[index].add(delta)
                cached[index // n] = max(cached[index // n], delta.num_cached_tokens)

        task = asyncio.create_task(run())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and (self.drain_expired or await raw.is_disconnected()):
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                if self.drain_expired:
                    raise APIError(503, DRAIN_EXPIRED, "ServiceUnavailableError")
                raise APIError(499, "client disconnected", "ClientDisconnected")
        task.result()
        return cached

    async def _guard(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """Once a stream has started its status is sent: a failure (the engine died) or a shutdown whose
        drain time runs out becomes an error event, then `[DONE]`, so that clients end cleanly instead of
        waiting or seeing a broken response."""
        try:
            async for chunk in chunks:
                if self.drain_expired:
                    await chunks.aclose()  # aborts the request
                    yield sse({"error": {"message": DRAIN_EXPIRED, "type": "ServiceUnavailableError",
                                         "param": None, "code": 503}})
                    yield "data: [DONE]\n\n"
                    return
                yield chunk
        except EngineDeadError as exc:
            yield sse({"error": {"message": f"the engine is not available: {exc}", "type": "ServiceUnavailableError",
                                 "param": None, "code": 503}})
            yield "data: [DONE]\n\n"

    @staticmethod
    def usage(prompts: list[list[int]], completion_tokens: int, cached: list[int]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(cached)}}

    # ----------------------------------------------------------------------------- logprobs
    def prompt_logprobs(self, prompt_ids: list[int], entries: Optional[list[TokenLogprobs]]) -> Optional[list]:
        """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}."""
        if entries is None:
            return None
        out: list = [None]
        for token, lp in zip(prompt_ids[1:], entries):
            item = {str(t): {"logprob": v, "rank": r, "decoded_token": self.token_text(t)}
                    for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1)}
            item[str(token)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_text(token)}
            out.append(item)
        return out

    def completion_logprobs(self, entries: list[tuple[int, Optional[TokenLogprobs]]], offset: int) -> dict:
        """The completions shape; an entry without logprobs (the first token of an echoed prompt, which
        nothing predicts) gets None, as in OpenAI's and vLLM's responses."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, lp in entries:
            text = self.token_text(token)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            if lp is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(lp.logprob)
            alternatives = {self.token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            alternatives.setdefault(text, lp.logprob)
            top.append(alternatives)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    def echo_logprobs(self, prompt_ids: list[int], entries: Optional[list[TokenLogprobs]],
                      generated: dict) -> dict:
        """An echoed prompt's logprobs (the engine's prompt logprobs) followed by the generated ones."""
        prompt = self.completion_logprobs(list(zip(prompt_ids, [None, *(entries or [])])), 0)
        return {key: prompt[key] + generated[key] for key in prompt}

    def chat_logprobs(self, entries: list[tuple[int, TokenLogprobs]]) -> dict:
        def item(token: int, value: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(token, lp.logprob),
                             "top_logprobs": [item(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                            for token, lp in entries]}

    # ---------------------------------------------------------------------------- completions
    def completion_prompts(self, req: CompletionRequest) -> list[tuple[Optional[str], list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            p = [p]
        self.check_text_length(text_chars(p), "prompt")
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            p = [p]
        prompts = []
        for item in p:
            if isinstance(item, str):
                prompts.append((item, self.tokenizer.encode(item, add_special_tokens=True)))
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                # The engine checks ids against the model's vocabulary; the tokenizer (echo decodes the
                # prompt here) takes 32-bit ids and fails on larger ones.
                bad = next((t for t in item if not 0 <= t < 2**32), None)
                if bad is not None:
                    raise APIError(400, f"prompt token ids must be below 2^32, got {bad}", param="prompt")
                prompts.append((None, list(item)))
            else:
                raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or "
                               "a list of token-id lists", param="prompt")
        return prompts

    async def completions(self, req: CompletionRequest, raw: Request):
        model = self.check_model(req.model)
        params = req.to_sampling_params()
        prompts = await self.tokenize_off_loop(self.completion_prompts, text_chars(req.prompt), req)
        # echo with logprobs: the prompt's own logprobs come first, so the engine computes them too.
        echo_logprobs = req.echo and params.logprobs is not None
        wants_prompt_logprobs = params.prompt_logprobs is not None
        if echo_logprobs:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
        # echo alone needs a token-id prompt's text
        texts = [t if t is not None or not req.echo else self.tokenizer.decode(ids) for t, ids in prompts]
        ids_list = [ids for _, ids in prompts]
        timer = RequestTimer(self.metrics)
        streams = await self._submit(raw, req, ids_list, params, lambda i: None)
        n, created = params.n, int(time.time())
        response_id = f"cmpl-{uuid.uuid4().hex}"
        prefixes = [texts[i // n] if req.echo else "" for i in range(len(prompts) * n)]
        if req.stream:
            return StreamingResponse(self._guard(self._stream_completions(
                req, streams, ids_list, prefixes, model, created, response_id, timer, echo_logprobs)),
                media_type="text/event-stream")
        choices = [Choice(i, prefixes[i]) for i in range(len(prompts) * n)]
        cached = await self._collect(raw, streams, n, choices, timer)
        if req.prompt_only:  # the prompt alone: drop the one token generated
            for c in choices:
                c.text, c.token_ids, c.logprobs = prefixes[c.index], [], []
                if c.finish_reason in ("stop", "length"):
                    c.finish_reason, c.stop_reason = "length", None
        body_choices = []
        for c in choices:
            logprobs = None
            if params.logprobs is not None:
                logprobs = self.completion_logprobs(c.logprobs, len(prefixes[c.index]))
                if echo_logprobs:
                    logprobs = self.echo_logprobs(ids_list[c.index // n], c.prompt_logprobs, logprobs)
            choice = {"index": c.index, "text": c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = ids_list[c.index // n]
            if wants_prompt_logprobs:
                choice["prompt_logprobs"] = self.prompt_logprobs(ids_list[c.index // n], c.prompt_logprobs)
            body_choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return JSONResponse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                             "choices": body_choices, "usage": self.usage(ids_list, completion_tokens, cached)})

    async def _stream_completions(self, req, streams, ids_list, prefixes, model, created, response_id, timer,
                                  echo_logprobs=False):
        n = req.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        offsets = [len(p) for p in prefixes]
        echoed = [False] * len(prefixes)
        completion_tokens, cached = 0, [0] * len(streams)
        async for index, delta in self._merge(streams, n, timer):
            if req.prompt_only:  # the prompt alone: drop the one token generated
                ended = delta.finish_reason in ("stop", "length")
                delta = dataclasses.replace(delta, text="", token_ids=[], logprobs=None,
                                            finish_reason="length" if ended else delta.finish_reason,
                                            stop_reason=None if ended else delta.stop_reason)
            completion_tokens += len(delta.token_ids)
            cached[index // n] = max(cached[index // n], delta.num_cached_tokens)
            text, first = delta.text, not echoed[index]
            if first:
                text, echoed[index] = prefixes[index] + text, True
            if not text and not delta.finished and not delta.logprobs:
                continue
            choice = {"index": index, "text": text, "logprobs": None,
                      "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
            if delta.logprobs:
                choice["logprobs"] = self.completion_logprobs(list(zip(delta.token_ids, delta.logprobs)), offsets[index])
            if first and echo_logprobs:  # the echoed prompt's logprobs lead the first chunk
                choice["logprobs"] = self.echo_logprobs(ids_list[index // n], delta.prompt_logprobs,
                                                        choice["logprobs"] or self.completion_logprobs([], 0))
            offsets[index] += len(delta.text)
            if req.return_token_ids:
                choice["token_ids"] = delta.token_ids
            chunk = {"id": response_id, "object": "text_completion", "created": created, "model": model,
                     "choices": [choice]}
            if continuous:
                chunk["usage"] = self.usage(ids_list, completion_tokens, cached)
            yield sse(chunk)
        if include_usage:
            yield sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": self.usage(ids_list, completion_tokens, cached)})
        yield "data: [DONE]\n\n"

    # ----------------------------------------------------------------------------------- chat
    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        self.check_text_length(messages_chars(req.messages), "messages")
        messages = []
        for m in req.messages:
            message = m.model_dump(exclude_none=True)
            message.setdefault("content", "")  # an assistant turn of tool calls only: templates read content
            if isinstance(m.content, list):
                message["content"] = "".join(part.get("text", "") for part in m.content
                                             if part.get("type") in ("text", "input_text"))
            if m.reasoning is not None and m.reasoning_content is None:
                message["reasoning_content"] = m.reasoning
            messages.append(message)
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if "chat_template" in (req.chat_template_kwargs or {}) and not self.trust_request_chat_template:
            # A template is a program (Jinja) run on this server: one loop of 50,000 held the event loop 1.7 s.
            raise APIError(400, "chat_template_kwargs.chat_template: this server does not run chat templates sent "
                           "by requests (start it with --trust-request-chat-template to allow them)",
                           param="chat_template_kwargs")
        if req.tools and not self.template_renders_tools:
            raise APIError(400, "tools: the chat template in use does not render tools, so the model would never "
                           "see them (start the server with --chat-template chatml-tools, or a template that "
                           "does)", param="tools")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tools=req.tools,
                **(req.chat_template_kwargs or {}))
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        model = self.check_model(req.model)
        params = req.to_sampling_params()
        tools = ToolRequest(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser)
        tool_spec = tools.structured()  # built once: for auto it holds every tool's schema
        if tool_spec is not None and not (tools.mode == "auto" and params.structured_outputs is not None):
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice {tools.mode} cannot be combined with {req.structured_field()}",
                               param="tool_choice")
            params.structured_outputs = tool_spec
        try:  # always off the loop and bounded: even the model's own template loops over any number of messages
            prompt_text, ids = await run_with_deadline(self.chat_prompt, self.chat_template_timeout, req)
        except DeadlineExceeded:
            raise APIError(400, f"rendering the chat template took longer than {self.chat_template_timeout:g} s "
                           "(--chat-template-timeout) and was stopped", param="messages") from None

        parser = make_reasoning_parser(self.reasoning_parser, prompt_text, req.chat_template_kwargs)
        if params.structured_outputs is not None and parser is not None:
            # as vLLM does: the thinking stays free, the constraint starts after the reasoning's end tag
            params.structured_outputs.start_after = parser.end_tag

        def reasoning_for(_):
            parsers = [make_reasoning_parser(self.reasoning_parser, prompt_text, req.chat_template_kwargs)
                       for _ in range(params.n)]
            return parsers if any(parsers) else None

        timer = RequestTimer(self.metrics)
        streams = await self._submit(raw, req, [ids], params, reasoning_for)
        created, response_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._guard(self._stream_chat(req, streams, ids, model, created, response_id,
                                                                   timer, tools)), media_type="text/event-stream")
        choices = [Choice(i) for i in range(params.n)]
        cached = await self._collect(raw, streams, params.n, choices, timer)
        body_choices = []
        for c in choices:
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if tools.active:
                content, calls = tools.split(c.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": tool_calls_message(calls)}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            if c.reasoning:
                message["reasoning"] = message["reasoning_content"] = c.reasoning
            choice = {"index": c.index, "message": message,
                      "logprobs": self.chat_logprobs(c.logprobs) if params.logprobs is not None else None,
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            body_choices.append(choice)
        body = {"id": response_id, "object": "chat.completion", "created": created, "model": model,
                "choices": body_choices,
                "usage": self.usage([ids], sum(len(c.token_ids) for c in choices), cached)}
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        if params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(ids, choices[0].prompt_logprobs)
        return JSONResponse(body)

    async def _stream_chat(self, req, streams, ids, model, created, response_id, timer, tools: ToolRequest):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
        completion_tokens, cached = 0, [0]
        tool_streams = [tools.stream() for _ in range(req.n)] if tools.active else None
        for index in range(req.n):
            chunk = {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if continuous:
                chunk["usage"] = self.usage([ids], 0, cached)
            yield sse(chunk)
        async for index, delta in self._merge(streams, req.n, timer):
            completion_tokens += len(delta.token_ids)
            cached[0] = max(cached[0], delta.num_cached_tokens)
            if not delta.text and not delta.reasoning and not delta.finished and not delta.logprobs:
                continue
            text, calls, finish_reason = delta.text, [], delta.finish_reason
            if tool_streams is not None:  # content that cannot become a call, and the calls' deltas
                text, calls = tool_streams[index].feed(delta.text, delta.finished)
                if delta.finished and finish_reason == "stop" and tool_streams[index].has_calls:
                    finish_reason = "tool_calls"
                if not text and not calls and not delta.reasoning and not delta.finished and not delta.logprobs:
                    continue
            message = {}
            if delta.reasoning:
                message["reasoning"] = message["reasoning_content"] = delta.reasoning
            if text or not (delta.reasoning or calls):
                message["content"] = text
            if calls:
                message["tool_calls"] = calls
            choice = {"index": index, "delta": message, "logprobs": None, "finish_reason": finish_reason}
            if delta.finished:
                choice["stop_reason"] = delta.stop_reason
            if delta.logprobs:
                choice["logprobs"] = self.chat_logprobs(list(zip(delta.token_ids, delta.logprobs)))
            if req.return_token_ids:
                choice["token_ids"] = delta.token_ids
            chunk = {**head, "choices": [choice]}
            if continuous:
                chunk["usage"] = self.usage([ids], completion_tokens, cached)
            yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": self.usage([ids], completion_tokens, cached)})
        yield "data: [DONE]\n\n"
