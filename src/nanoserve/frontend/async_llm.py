"""`AsyncLLM`: the API server's handle on the engine. `generate()` fans a request out into its `n`
completions, sends them to the engine core, and yields `CompletionDelta`s from a per-request queue
that the output pump fills; closing the generator early aborts whatever is unfinished."""
from __future__ import annotations

import asyncio
from typing import Callable, Optional


from nanoserve.engine.client import EngineCoreClient, EngineDeadError
from nanoserve.frontend.output_processor import CompletionDelta, OutputProcessor
from nanoserve.frontend.reasoning import ReasoningParser
from nanoserve.frontend.tokenizer import engine_requests
from nanoserve.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, tokenizer, address: str, identity: bytes,
                 on_dead: Optional[Callable[[str], None]] = None):
        """`on_dead`: called once after every in-flight request got the engine's death notice."""
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its deltas (or an exception)
        self.client = EngineCoreClient(address, identity, self._on_outputs, self._on_dead)
        self.info = None
        self.on_dead = on_dead

    async def start(self, **kw):
        self.info = await self.client.start(**kw)
        return self.info

    @property
    def dead(self) -> Optional[str]:
        return self.client.dead

    @property
    def stats(self):
        return self.client.stats

    def _on_outputs(self, outputs) -> None:
        deltas, to_abort = self.processor.process(outputs)
        for delta in deltas:
            queue = self.queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
        if to_abort:  # stop strings found here: the engine can free those requests now
            self.client.abort_soon(to_abort)

    def _on_dead(self, reason: str) -> None:
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     reasoning: Optional[list[Optional[ReasoningParser]]] = None) -> "RequestStream":
        """Sends the request's `n` completions to the engine core; returns once all are accepted.
        Raises `RequestRejected` or `EngineDeadError` (after withdrawing any that got in).
        `reasoning`: one parser per completion, or None."""
        stream = RequestStream(self, request_id, params.n)
        self.queues[request_id] = stream.queue
        try:
            for k, child in enumerate(engine_requests(self.tokenizer, request_id, prompt_token_ids, params)):
                self.processor.add_request(child.request_id, request_id, k, params,
                                           reasoning[k] if reasoning else None)
                stream.children.append(child.request_id)
                await self.client.add_request(child)
        except BaseException:
            stream.abort()
            raise
        return stream

    def close(self) -> None:
        self.client.close()


class RequestStream:
    """The deltas of one submitted request, all its completions interleaved as they come."""

    def __init__(self, llm: AsyncLLM, request_id: str, n: int):
        self.llm, self.request_id, self.unfinished = llm, request_id, n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.children: list[str] = []

    def __aiter__(self):
        return self

    async def __anext__(self) -> CompletionDelta:
        if not self.unfinished:
            self.llm.queues.pop(self.request_id, None)
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.unfinished = 0
            raise item
        if item.finished:
            self.unfinished -= 1
        return item

    def abort(self) -> None:
        """Withdraws whatever has not finished (a client that went away), so the engine frees its KV
        blocks. Synchronous: it must work inside a cancelled task, where any await would be cancelled."""
        self.llm.queues.pop(self.request_id, None)
        processor = self.llm.processor
        left = [c for c in self.children if processor.has(c)]
        for child_id in left:
            processor.remove(child_id)
        self.unfinished = 0
        if left and not self.llm.client.dead:
            self.llm.client.abort_soon(left)
