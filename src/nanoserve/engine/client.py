"""`EngineCoreClient`: the API server's connection to the engine-core process (a ZMQ DEALER socket,
msgpack frames). Waits for the ready message, sends requests and aborts, pumps outputs to a callback,
and notices a dead engine core (a death notice, or its process gone) so nothing waits forever."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from nanoserve.protocol import (AbortRequests, AddRequest, EngineCoreOutputs, EngineCoreRequest, Hello, ModelInfo,
                                Rejection, SchedulerStats)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestRejected(Exception):
    def __init__(self, rejection: Rejection):
        super().__init__(rejection.message)
        self.status, self.param = rejection.status, rejection.param


class EngineCoreClient:
    def __init__(self, address: str, identity: bytes,
                 on_outputs: Callable[[list], None], on_dead: Callable[[str], None]):
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self.info: Optional[ModelInfo] = None
        self.stats: Optional[SchedulerStats] = None
        self.dead: Optional[str] = None
        self.pending: dict[str, asyncio.Future] = {}  # request id -> accepted / rejected
        self.pump_task: Optional[asyncio.Task] = None
        self.background: set[asyncio.Task] = set()

    async def start(self, timeout: float = 600.0, poll: float = 1.0,
                    core_alive: Callable[[], bool] = lambda: True) -> ModelInfo:
        """Says hello and waits for the engine core's ready message (it may still be loading)."""
        await self.socket.send(self.encoder.encode(Hello()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.info is None:
            if loop.time() > deadline or not core_alive():
                raise EngineDeadError("the engine core did not become ready")
            if await self.socket.poll(int(poll * 1000)):
                self._handle(self.decoder.decode(await self.socket.recv()))
        self.pump_task = asyncio.create_task(self._pump())
        return self.info

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Sends a request and returns once the engine core accepted it; raises `RequestRejected`."""
        if self.dead:
            raise EngineDeadError(self.dead)
        future = asyncio.get_running_loop().create_future()
        self.pending[request.request_id] = future
        await self.socket.send(self.encoder.encode(AddRequest(request)))
        await future

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            await self.socket.send(self.encoder.encode(AbortRequests(request_ids)))

    def abort_soon(self, request_ids: list[str]) -> None:
        """Sends an abort from a task of its own (callable from sync code and cancelled tasks)."""
        task = asyncio.get_running_loop().create_task(self.abort(request_ids))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _core_alive(self) -> bool:
        if self.info is None:
            return True
        try:
            os.kill(self.info.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        try:  # a dead process that its parent has not reaped yet still has a pid: a zombie
            with open(f"/proc/{self.info.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return True

    async def _pump(self) -> None:
        try:
            while not self.dead:
                if not await self.socket.poll(1000):
                    if not self._core_alive():
                        self._die("the engine core process exited")
                    continue
                self._handle(self.decoder.decode(await self.socket.recv()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("output pump failed")
            self._die(f"lost the engine core: {exc}")

    def _handle(self, message: EngineCoreOutputs) -> None:
        if message.ready is not None:
            self.info = message.ready
        if message.stats is not None:
            self.stats = message.stats
        for request_id in message.accepted:
            future = self.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(None)
        for rejection in message.rejected:
            future = self.pending.pop(rejection.request_id, None)
            if future is not None and not future.done():
                future.set_exception(RequestRejected(rejection))
        if message.outputs:
            self.on_outputs(message.outputs)
        if message.dead is not None:
            self._die(message.dead)

    def _die(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = reason
        logger.error("%s", reason)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self.pending.clear()
        self.on_dead(reason)

    def close(self) -> None:
        if self.pump_task is not None:
            self.pump_task.cancel()
        self.socket.close()
        self.ctx.term()
