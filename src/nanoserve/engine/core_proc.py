"""`EngineCoreProc`: the engine-core process. A busy loop (drain inputs -> step -> hand outputs off)
around `EngineCore`, with one IO thread that owns the ZMQ ROUTER socket: it decodes and checks
incoming requests and encodes outgoing results while the loop computes."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import queue
import signal
import threading
import time
from typing import Optional

import msgspec
import zmq

from nanoserve.config import EngineConfig
from nanoserve.engine.core import EngineCore, PromptTooLongError
from nanoserve.protocol import AbortRequests, CoreInput, EngineCoreOutputs, Hello, ModelInfo, Rejection
from nanoserve.sampling_params import field_of_error

logger = logging.getLogger(__name__)


def heap_trimmer():
    """glibc's malloc_trim, or None off glibc. A step's large transient buffers (a prefill's activations,
    the kernels' scratch) are freed into the heap and kept there: measured on SmolLM2 Q8_0, 64 requests
    left ~100 MB (offline) to ~290 MB (served) resident that trimming returns to the system."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class EngineCoreProc:
    def __init__(self, engine: EngineCore, address: str, max_waiting_requests: int = 0):
        self.engine = engine
        self.max_waiting = max_waiting_requests
        self.inputs: queue.Queue = queue.Queue()  # for the loop: (checked request, max_tokens) | AbortRequests
        self.outbox: queue.Queue = queue.Queue()  # (client identity, EngineCoreOutputs) for the IO thread
        # Requests put into `inputs` (by the IO thread) and taken from it (by the loop): each counter has one
        # writer, and their difference is what waits there (aborts in `inputs` are not waiting requests).
        self.num_inputs_put = self.num_inputs_taken = 0
        self.owner: dict[str, bytes] = {}  # request id -> the frontend that sent it
        self.clients: set[bytes] = set()
        self.idle_seconds = 0.0
        self.ctx = zmq.Context()
        self.wake_address = f"inproc://wake-{id(self)}"
        self.wake_send = self.ctx.socket(zmq.PAIR)
        self.wake_send.bind(self.wake_address)
        self.address = address
        self.io_thread = threading.Thread(target=self._io_loop, name="engine-io", daemon=True)
        self.info = ModelInfo(engine.max_model_len, engine.model_config.vocab_size,
                              engine.config.max_logprobs, os.getpid(), engine.compute,
                              engine.config.cache.block_size)
        self.stopping = False
        self.trim_heap = heap_trimmer()

    # ------------------------------------------------------------------------------ IO thread
    def _io_loop(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(self.address)
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self.wake_address)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        decoder = msgspec.msgpack.Decoder(CoreInput)
        encoder = msgspec.msgpack.Encoder()
        while True:
            events = dict(poller.poll())
            if wake in events:
                wake.recv()
                while True:
                    try:
                        identity, message = self.outbox.get_nowait()
                    except queue.Empty:
                        break
                    self._send(router, identity, encoder.encode(message))
            if router in events:
                identity, payload = router.recv_multipart()
                try:
                    message = decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    logger.error("undecodable message from %r: %s", identity, exc)
                    continue
                reply = self._receive(identity, message)
                if reply is not None:
                    self._send(router, identity, encoder.encode(reply))

    def _send(self, router, identity: bytes, payload: bytes) -> None:
        try:
            router.send_multipart([identity, payload])
        except zmq.error.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # Every frontend said hello first, so it was routable: this one has gone away (an API
            # server that exited). Forget it rather than block the others.
            if identity in self.clients:
                logger.warning("frontend %r is gone", identity)
                self.clients.discard(identity)

    def _receive(self, identity: bytes, message) -> Optional[EngineCoreOutputs]:
        """Runs on the IO thread: checks a new request at once so the frontend learns of a rejection
        before it starts a stream; the loop picks accepted ones up from `inputs`."""
        if isinstance(message, Hello):
            self.clients.add(identity)
            return EngineCoreOutputs(ready=self.info, stats=self.engine.stats())
        if isinstance(message, AbortRequests):
            self.inputs.put(message)
            return None
        request = message.request
        try:
            if self.max_waiting and len(self.engine.scheduler.waiting) + self.num_inputs_put - self.num_inputs_taken \
                    >= self.max_waiting:
                return EngineCoreOutputs(rejected=[Rejection(
                    request.request_id, 503, f"the server is overloaded: {self.max_waiting} requests are "
                    "already waiting; retry later")])
            max_tokens = self.engine.check_request(request)
            grammar = self.engine.grammar_state(request)  # compiled here, off the engine loop
        except PromptTooLongError as exc:
            return EngineCoreOutputs(rejected=[Rejection(request.request_id, 400, str(exc), "prompt")])
        except ValueError as exc:
            return EngineCoreOutputs(rejected=[Rejection(request.request_id, 400, str(exc), field_of_error(str(exc)))])
        self.owner[request.request_id] = identity
        self.inputs.put((request, max_tokens, grammar))  # checked: the loop only queues it
        self.num_inputs_put += 1
        return EngineCoreOutputs(accepted=[request.request_id])

    def _post(self, identity: bytes, message: EngineCoreOutputs) -> None:
        self.outbox.put((identity, message))
        self.wake_send.send(b"")

    # ---------------------------------------------------------------------------- busy loop
    def run(self) -> None:
        self.io_thread.start()
        engine = self.engine
        was_busy = False
        while not self.stopping:
            idle = not engine.has_unfinished()
            if idle and was_busy and self.trim_heap is not None:
                self.trim_heap(0)  # the last request just ended: hand its freed buffers back
            was_busy = not idle
            changed = self._drain_inputs(block=idle)
            outputs = engine.step() if engine.has_unfinished() else []
            if not outputs and not changed and not idle:
                continue  # a step of prefill chunks only: nothing to tell
            # (An idle wait that timed out still sends stats, so the gauges stay current.)
            by_client: dict[bytes, list] = {}
            for out in outputs:
                identity = self.owner.get(out.request_id)
                if identity is not None:
                    by_client.setdefault(identity, []).append(out)
                if out.finished:
                    self.owner.pop(out.request_id, None)
            stats = engine.stats()
            stats.idle_seconds = self.idle_seconds
            for identity in list(self.clients):
                self._post(identity, EngineCoreOutputs(outputs=by_client.get(identity, []), stats=stats))

    def _drain_inputs(self, block: bool) -> bool:
        """Applies every queued input; with nothing to run, first waits for one (time counted as idle)."""
        changed = False
        if block:
            start = time.perf_counter()
            try:
                item = self.inputs.get(timeout=0.5)
            except queue.Empty:
                return False
            finally:
                self.idle_seconds += time.perf_counter() - start
            changed |= self._apply(item)
        while True:
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return changed
            changed |= self._apply(item)

    def _apply(self, item) -> bool:
        if isinstance(item, tuple):  # (request, max_tokens, grammar), checked on the IO thread
            self.num_inputs_taken += 1  # before it joins `waiting`: never counted twice
            self.engine.add_request(*item)
            return True
        for request_id in item.request_ids:
            self.engine.abort(request_id)
            self.owner.pop(request_id, None)
        return True

    def fail(self, message: str) -> None:
        for identity in list(self.clients):
            self._post(identity, EngineCoreOutputs(dead=message))


def _exit_with_parent(parent_pid: int) -> None:
    """A process whose starter was killed (SIGKILL leaves no time to stop it: a Ray replica, a launcher)
    is re-parented; then nobody is left to serve, so it exits instead of holding its memory."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    logger.warning("the process that started this engine core is gone; exiting")
    os._exit(0)


def run_engine_core(config: EngineConfig, address: str, max_waiting_requests: int = 0,
                    log_level: str = "INFO", name: str = "engine-core") -> None:
    """Entry point of an engine-core process. Exits non-zero when the engine fails, after telling
    every frontend so that their in-flight requests end with an error instead of hanging."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop (SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    try:
        engine = EngineCore(config)
    except Exception as exc:
        logger.error("engine core failed to start: %s", exc)
        os._exit(3)
    proc = EngineCoreProc(engine, address, max_waiting_requests)
    try:
        proc.run()
    except Exception as exc:
        logger.exception("engine core failed")
        proc.fail(f"engine core failed: {exc}")
        time.sleep(0.5)  # let the IO thread deliver the notice
        os._exit(1)
