"""`AsyncLLM`: the API server's handle on the engine cores (one, or several data-parallel ones).
`submit()` routes a request to one core, fans it out into its `n` completions there, and its stream
yields `CompletionDelta`s from a per-request queue that the output pumps fill; aborting it withdraws
whatever is unfinished from that core."""
from __future__ import annotations

import asyncio
from typing import Callable, Optional


from nanoserve.engine.client import EngineCoreClient, EngineDeadError
from nanoserve.frontend.output_processor import CompletionDelta, OutputProcessor
from nanoserve.frontend.reasoning import ReasoningParser
from nanoserve.frontend.router import EngineRouter, RouterConfig
from nanoserve.frontend.tokenizer import engine_requests
from nanoserve.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, tokenizer, addresses: list[str], identity: bytes,
                 on_dead: Optional[Callable[[str], None]] = None, prefix_affinity: bool = True):
        """`addresses`: one per engine core. `on_dead`: called once, after every in-flight request (on every
        core) got the death notice of a core."""
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its deltas (or an exception)
        self.clients = [EngineCoreClient(address, identity, self._outputs_handler(i), self._on_dead)
                        for i, address in enumerate(addresses)]
        self.info = None
        self.on_dead = on_dead
        self.prefix_affinity = prefix_affinity
        self.router = EngineRouter(len(addresses))
        self.child_load: dict[str, list[int]] = {}  # engine request id -> [engine, tokens counted in its load]
        self.dead_reason: Optional[str] = None

    async def start(self, **kw):
        infos = await asyncio.gather(*(client.start(**kw) for client in self.clients))
        self.info = infos[0]
        self.router = EngineRouter(len(self.clients), RouterConfig(affinity=self.prefix_affinity,
                                                                   block_size=self.info.block_size))
        return self.info

    @property
    def dead(self) -> Optional[str]:
        return self.dead_reason

    @property
    def engine_stats(self) -> list:
        """Each core's latest scheduler stats (None until its first)."""
        return [client.stats for client in self.clients]

    def _outputs_handler(self, engine: int) -> Callable[[list], None]:
        return lambda outputs: self._on_outputs(engine, outputs)

    def _on_outputs(self, engine: int, outputs) -> None:
        if len(self.clients) > 1:
            self._count_load(engine, outputs)
        deltas, to_abort = self.processor.process(outputs)
        for delta in deltas:
            queue = self.queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
        if to_abort:  # stop strings found here: the engine can free those requests now
            self.clients[engine].abort_soon(to_abort)
            for child_id in to_abort:
                self._release(child_id)

    def _count_load(self, engine: int, outputs) -> None:
        router, loads = self.router, self.child_load
        for out in outputs:
            entry = loads.get(out.request_id)
            if entry is None:
                continue
            n = len(out.new_token_ids)
            entry[1] += n
            router.add(engine, n)
            if out.finished:
                self._release(out.request_id)

    def _release(self, child_id: str) -> None:
        entry = self.child_load.pop(child_id, None)
        if entry is not None:
            self.router.add(entry[0], -entry[1])

    def _on_dead(self, reason: str) -> None:
        """One core died: every request in flight, on any core, ends with the error (the server stops)."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     reasoning: Optional[list[Optional[ReasoningParser]]] = None) -> "RequestStream":
        """Sends the request's `n` completions to the engine core; returns once all are accepted.
        Raises `RequestRejected` or `EngineDeadError` (after withdrawing any that got in).
        `reasoning`: one parser per completion, or None."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        for i, client in enumerate(self.clients):  # each core's load as of its latest stats
            if client.stats is not None:
                self.router.report(i, client.stats.load_tokens)
        engine = self.router.choose(prompt_token_ids)  # all n completions share the prompt: one core
        stream = RequestStream(self, request_id, params.n, engine)
        self.queues[request_id] = stream.queue
        client = self.clients[engine]
        try:
            for k, child in enumerate(engine_requests(self.tokenizer, request_id, prompt_token_ids, params)):
                self.processor.add_request(child.request_id, request_id, k, params,
                                           reasoning[k] if reasoning else None)
                stream.children.append(child.request_id)
                if len(self.clients) > 1:
                    self.child_load[child.request_id] = [engine, len(prompt_token_ids)]
                    self.router.add(engine, len(prompt_token_ids))
                await client.add_request(child)
        except BaseException:
            stream.abort()
            raise
        return stream

    def close(self) -> None:
        for client in self.clients:
            client.close()


class RequestStream:
    """The deltas of one submitted request, all its completions interleaved as they come."""

    def __init__(self, llm: AsyncLLM, request_id: str, n: int, engine: int = 0):
        self.llm, self.request_id, self.unfinished, self.engine = llm, request_id, n, engine
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
        for child_id in self.children:
            self.llm._release(child_id)
        self.unfinished = 0
        client = self.llm.clients[self.engine]
        if left and not client.dead:
            client.abort_soon(left)
