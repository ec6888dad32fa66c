"""`EngineCoreClient`: the API server's connection to the engine-core process (a ZMQ DEALER socket,
msgpack frames). Waits for the ready message, sends requests and aborts, pumps outputs to a callback,
and notices a dead engine core (a death notice, or its process gone) so nothing waits forever. The
socket is a plain one read from the event loop's own reader callback: zmq.asyncio's futures cost
~40% of the API server's CPU per streamed token (py-spy, concurrency 1)."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Optional

import msgspec
import zmq

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
        self.ctx = zmq.Context()
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
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.watch: Optional[asyncio.TimerHandle] = None

    async def start(self, timeout: float = 600.0, poll: float = 1.0,
                    core_alive: Callable[[], bool] = lambda: True) -> ModelInfo:
        """Says hello and waits for the engine core's ready message (it may still be loading)."""
        self.loop = loop = asyncio.get_running_loop()
        loop.add_reader(self.socket.getsockopt(zmq.FD), self._readable)
        self._send(Hello())
        deadline = loop.time() + timeout
        while self.info is None:
            if self.dead or loop.time() > deadline or not core_alive():
                raise EngineDeadError("the engine core did not become ready")
            await asyncio.sleep(min(poll, 0.05))
        self.watch = loop.call_later(1.0, self._check_alive)
        return self.info

    def _send(self, message) -> None:
        # NOTE: ZMQ's FD signals edges: a send can consume the event that said input is waiting, so
        # look again once this callback is done.
        self.socket.send(self.encoder.encode(message))
        if self.loop is not None:
            self.loop.call_soon(self._readable)

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Sends a request and returns once the engine core accepted it; raises `RequestRejected`."""
        if self.dead:
            raise EngineDeadError(self.dead)
        future = asyncio.get_running_loop().create_future()
        self.pending[request.request_id] = future
        self._send(AddRequest(request))
        await future

    def abort_soon(self, request_ids: list[str]) -> None:
        """Sends an abort now (callable from sync code and cancelled tasks)."""
        if request_ids and not self.dead:
            self._send(AbortRequests(request_ids))

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

    def _readable(self) -> None:
        """Reads every message waiting (the event loop calls this when the socket's FD fires)."""
        try:
            while not self.dead and self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._handle(self.decoder.decode(self.socket.recv(zmq.NOBLOCK)))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EAGAIN and not self.socket.closed:
                logger.exception("output pump failed")
                self._die(f"lost the engine core: {exc}")
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("output pump failed")
            self._die(f"lost the engine core: {exc}")

    def _check_alive(self) -> None:
        if self.dead:
            return
        if not self._core_alive():
            self._die("the engine core process exited")
            return
        self._readable()  # and a look at the socket, should an edge have been missed
        self.watch = self.loop.call_later(1.0, self._check_alive)

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
        if self.watch is not None:
            self.watch.cancel()
        if self.loop is not None and not self.socket.closed:
            try:
                self.loop.remove_reader(self.socket.getsockopt(zmq.FD))
            except (RuntimeError, ValueError):  # the loop is already closed
                pass
        self.socket.close()
        self.ctx.term()
