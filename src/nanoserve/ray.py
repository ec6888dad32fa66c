"""nanoserve on Ray Serve, for more than one machine: `NanoserveReplica` (one engine core and the whole
OpenAI HTTP layer in each replica), an `OpenAIIngress` that forwards each HTTP request to one replica,
and `PrefixAffinityRouter`, Ray Serve's request router with nanoserve's prefix affinity. Needs the
optional extra: `pip install 'nanoserve[ray]'`. Start: `serve run nanoserve.ray:build_app model=PATH`."""
# No `from __future__ import annotations`: Ray builds the ingress routes from their live signatures.

import asyncio
import json
import logging
import multiprocessing
import os
import tempfile
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from nanoserve.frontend.router import PrefixMemory, prefix_block_hashes

logger = logging.getLogger("nanoserve.ray")

REPLICA_HEADER = "x-nanoserve-replica"  # which replica answered (debugging, and the tests' view of routing)


@dataclass
class RouteKey:
    """What the router sees of a request: its prompt text (the ingress does not tokenize)."""
    text: str


def prompt_text(body: bytes) -> str:
    """A completion's prompt or a chat's message contents, joined; "" for anything else."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""

    def text(value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "".join(text(v) for v in value)
        if isinstance(value, dict):
            return text(value.get("content", value.get("text", "")))
        return ""

    return text(data.get("prompt", data.get("messages", "")))


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas by (ongoing requests - weight x the share of the prompt sent to them before), so
    that a prompt goes where its prefix is cached unless that replica is busier by more than `weight`
    requests. Prefixes are chained hashes of `block_chars`-character blocks of the prompt text."""

    def initialize_state(self, block_chars: int = 64, max_blocks: int = 128, capacity: int = 1 << 16,
                         cached_share_weight: float = 4.0):
        self.block_chars, self.max_blocks, self.weight = block_chars, max_blocks, cached_share_weight
        self.prefixes = PrefixMemory(capacity)

    def _hashes(self, pending_request: Optional[PendingRequest]) -> tuple[list[int], int]:
        key = pending_request.args[0] if pending_request is not None and pending_request.args else None
        text = key.text if isinstance(key, RouteKey) else ""
        return prefix_block_hashes(text, self.block_chars, self.max_blocks), len(text)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        hashes, length = self._hashes(pending_request)
        matched = self.prefixes.matched(hashes, len(candidate_replicas)) if hashes else {}

        def cost(replica: RunningReplica) -> float:
            ongoing = self._replica_queue_len_cache.get(replica.replica_id) or 0
            share = matched.get(replica.replica_id.to_full_id_str(), 0) * self.block_chars / max(1, length)
            return ongoing - self.weight * share

        return [[replica] for replica in sorted(candidate_replicas, key=cost)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        hashes, _ = self._hashes(pending_request)
        if hashes:
            self.prefixes.record(hashes, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(replica_id.to_full_id_str())


async def asgi_stream(app, method: str, path: str, headers: list, body: bytes) -> AsyncIterator:
    """Runs one HTTP request through an ASGI app in this process: yields the response start
    (`{"status", "headers"}`), then the body chunks as the app sends them. Closing the iterator early is
    a client disconnect, which the app sees (and aborts the request on)."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run():
        try:
            await app(scope, receive, messages.put)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode(), v.decode()) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
        await task
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 5.0)  # the app aborts the request and returns
            except asyncio.TimeoutError:
                task.cancel()


class NanoserveReplica:
    """One engine-core process and the HTTP layer of an API server (the same app `nanoserve serve`
    runs), driven in process by the ingress's forwarded requests."""

    async def __init__(self, model: str, engine_options: dict, server_options: dict):
        from nanoserve.config import EngineConfig, ServerConfig
        from nanoserve.entrypoints.openai.api_server import create_app
        from nanoserve.entrypoints.openai.launcher import _engine_core_main
        from nanoserve.frontend.tokenizer import load_tokenizer

        settings = ServerConfig(model_path=model, **server_options)
        if not settings.served_model_names:
            settings.served_model_names = [os.path.splitext(os.path.basename(model.rstrip("/")))[0]]
        workdir = tempfile.mkdtemp(prefix="nanoserve-ray-")
        settings.engine_addresses = [f"ipc://{workdir}/engine.sock"]
        config = EngineConfig.from_kwargs(model, **engine_options)
        self.core = multiprocessing.get_context("spawn").Process(
            target=_engine_core_main, name="engine-core", daemon=True,
            args=(config, settings.engine_addresses[0], settings.max_waiting_requests, "INFO", None, "engine-core"))
        self.core.start()
        tokenizer = load_tokenizer(model)
        if settings.chat_template:
            from nanoserve.templates import resolve_chat_template
            tokenizer.chat_template = resolve_chat_template(settings.chat_template)
        self.app = create_app(settings, tokenizer)
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # connects to the engine core
        llm = self.app.state.llm
        while llm.info is None:
            if not self.core.is_alive():
                raise RuntimeError(f"the engine core exited with code {self.core.exitcode}")
            await asyncio.sleep(0.1)
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()

    async def handle(self, key: RouteKey, method: str, path: str, headers: list, body: bytes) -> AsyncIterator:
        """`key` is for the router; the rest is the HTTP request. Yields the response start, then bytes."""
        raw_headers = [(k.encode(), v.encode()) for k, v in headers]
        async for item in asgi_stream(self.app, method, path, raw_headers, body):
            if isinstance(item, dict):
                item["headers"].append((REPLICA_HEADER, self.replica_id))
            yield item

    def check_health(self) -> None:
        """Ray replaces a replica whose engine core is gone."""
        if not self.core.is_alive() or self.app.state.llm.dead:
            raise RuntimeError("the engine core is not running")

    def __del__(self):
        if getattr(self, "core", None) is not None and self.core.is_alive():
            self.core.kill()


ingress_app = FastAPI(title="nanoserve on Ray Serve")


@serve.ingress(ingress_app)  # at import: a replica imports this module and must find the routes bound
class OpenAIIngress:
    """Forwards every HTTP request to one `NanoserveReplica` (chosen by the engine deployment's request
    router) and streams its answer back; a replica lost mid-answer ends it with an error, not a hang."""

    def __init__(self, engine):
        self.engine = engine.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "OPTIONS"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        headers.append(("content-length", str(len(body))))
        stream = self.engine.handle.remote(RouteKey(prompt_text(body)), request.method, target, headers, body)
        try:
            head = await stream.__anext__()
        except Exception as exc:  # the replica died before answering
            stream.cancel()
            return JSONResponse({"error": {"message": f"the engine is not available: {exc}", "type":
                                           "ServiceUnavailableError", "param": None, "code": 503}}, status_code=503)
        media = dict((k.lower(), v) for k, v in head["headers"]).get("content-type", "")
        is_sse = media.startswith("text/event-stream")

        async def rest():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:  # a replica lost mid-stream: the client gets an error, then the end
                if is_sse:
                    error = {"error": {"message": f"the engine is not available: {exc}",
                                       "type": "ServiceUnavailableError", "param": None, "code": 503}}
                    yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finally:
                stream.cancel()

        passed = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        return StreamingResponse(rest(), status_code=head["status"], headers=passed)


def build_app(args: dict):
    """The Ray Serve application (`serve run nanoserve.ray:build_app model=PATH num_replicas=2`).
    `args`: `model`; `num_replicas` (an int, or "auto" for Ray's autoscaling with `min_replicas` /
    `max_replicas`); `num_cpus` per replica (its engine's compute threads, default 1); `prefix_affinity`
    (default true); any other key is an engine option (`max_model_len=512`) or a server option
    (`served_model_names=[...]`, `chat_template=...`), as `nanoserve serve` takes them."""
    from nanoserve.config import ServerConfig, option_fields
    from nanoserve.model.default import default_model_path

    args = dict(args)
    model = args.pop("model", None) or default_model_path()
    num_cpus = float(args.pop("num_cpus", 1))
    num_replicas = args.pop("num_replicas", 1)
    min_replicas, max_replicas = int(args.pop("min_replicas", 1)), int(args.pop("max_replicas", 4))
    affinity = str(args.pop("prefix_affinity", True)).lower() not in ("false", "0", "no")
    server_names = {f.name for f in option_fields(ServerConfig)}
    server_options = {k: v for k, v in args.items() if k in server_names}
    engine_options = {k: v for k, v in args.items() if k not in server_names}
    engine_options.setdefault("num_threads", max(1, int(num_cpus)))
    options: dict = {"ray_actor_options": {"num_cpus": num_cpus}, "max_ongoing_requests": 256,
                     "health_check_period_s": 2, "health_check_timeout_s": 10}
    if affinity:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter)
    if str(num_replicas) == "auto":
        options["autoscaling_config"] = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": 32}
    else:
        options["num_replicas"] = int(num_replicas)
    engine = serve.deployment(NanoserveReplica, name="NanoserveReplica", **options).bind(
        model, engine_options, server_options)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    return ingress.bind(engine)
