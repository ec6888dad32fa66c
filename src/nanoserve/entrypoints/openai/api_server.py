"""The HTTP layer of one API-server process: FastAPI routes, OpenAI error shapes, API keys, CORS,
`X-Request-Id`, `/health`, `/metrics`; and `run_api_server`, the process entry point that serves on a
port shared with its sibling processes (SO_REUSEPORT) and exits non-zero if the engine core dies."""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from typing import Optional

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import nanoserve
from nanoserve.config import ServerConfig
from nanoserve.engine.client import EngineDeadError, RequestRejected
from nanoserve.entrypoints.openai.limits import PreReadRoute, RequestLimits
from nanoserve.entrypoints.openai.metrics import Metrics
from nanoserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                   TokenizeRequest)
from nanoserve.entrypoints.openai.serving import APIError, OpenAIServing, error_response
from nanoserve.frontend.async_llm import AsyncLLM
from nanoserve.sampling_params import field_of_error

logger = logging.getLogger("nanoserve.api")


OPEN_PATHS = ("/health", "/metrics")  # the only routes answered without the API key, when one is set


class RequestIdAndAuth:
    """API keys on every route but OPEN_PATHS, and the `X-Request-Id` echo, as plain ASGI middleware: Starlette's
    `@app.middleware("http")` wraps the request's receive channel, and behind it a handler never sees
    the client disconnect, so a non-streaming request ran to its end after its client had gone."""

    def __init__(self, app, api_keys: list[str]):
        self.app, self.api_keys = app, [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_keys and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = headers.get(b"authorization", b"")
            token = given[7:] if given.lower().startswith(b"bearer ") else b""
            if not any(hmac.compare_digest(token, key) for key in self.api_keys):
                response = error_response(401, "invalid or missing API key", "AuthenticationError",
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        request_id = headers.get(b"x-request-id")
        if request_id is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


ENGINE_GAUGE_PERIOD_S = 0.1  # each gauge write checks the pid and writes an mmap: not at every step
READY_WAIT_S = 5.0  # how long a request waits for this API server's engine handshake before a 503


def create_app(settings: ServerConfig, tokenizer) -> FastAPI:
    metrics = Metrics()

    def on_dead(reason: str) -> None:
        # In-flight requests got their errors through their queues; give the responses a moment to
        # go out, then exit non-zero so that the launcher stops the whole server.
        asyncio.get_running_loop().call_later(1.0, os._exit, 1)

    llm = AsyncLLM(tokenizer, settings.engine_addresses, f"api-{settings.index}-{os.getpid()}".encode(), on_dead,
                   prefix_affinity=settings.prefix_affinity)
    serving = OpenAIServing(llm, tokenizer, settings.served_model_names, metrics, settings.reasoning_parser,
                            settings.trust_request_chat_template, settings.chat_template_timeout,
                            settings.tool_call_parser)
    state, ready = {"ready": False}, asyncio.Event()

    async def connect():
        try:
            info = await llm.start()
        except EngineDeadError as exc:
            logger.error("%s", exc)
            os._exit(1)
        state["ready"], state["max_model_len"], state["compute"] = True, info.max_model_len, info.compute
        serving.set_max_model_len(info.max_model_len)
        ready.set()
        logger.info("engine core ready: max_model_len %d; %s", info.max_model_len, info.compute.summary())
        last = None
        while not llm.dead:  # engine-wide gauges follow the latest stats each core sent, 10 times a second
            stats = llm.engine_stats
            if all(s is not None for s in stats) and stats != last:
                metrics.update_engines(stats)
                last = stats
            await asyncio.sleep(ENGINE_GAUGE_PERIOD_S)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(connect())
        yield
        task.cancel()
        llm.close()

    app = FastAPI(title="nanoserve", version=nanoserve.__version__, lifespan=lifespan,
                  docs_url="/docs" if settings.enable_docs else None, redoc_url=None)
    app.router.route_class = PreReadRoute
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"])

    app.add_middleware(RequestIdAndAuth, api_keys=settings.api_keys)
    app.add_middleware(RequestLimits, settings=settings)  # added last: runs first

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            loc = []
        else:
            message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: "
                                f"{e.get('msg', '').removeprefix('Value error, ')}" for e in errors)
        return error_response(400, message, "BadRequestError", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """What the framework answers itself (no such route, wrong method, a body it cannot parse), in
        OpenAI's error shape like everything else."""
        if exc.status_code == 404:
            response = error_response(404, f"no such endpoint: {request.method} {request.url.path}", "NotFoundError")
        elif exc.status_code == 405:
            response = error_response(405, f"method {request.method} is not allowed on {request.url.path}",
                                      "MethodNotAllowedError")
        elif exc.status_code == 400:
            response = error_response(400, "malformed request body: not UTF-8 JSON that could be parsed (nested "
                                      "too deep, or a number too long?)", "BadRequestError")
        else:
            response = error_response(exc.status_code, str(exc.detail), "APIError")
        for name, value in (exc.headers or {}).items():  # 405's Allow
            response.headers[name] = value
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), "BadRequestError", field_of_error(str(exc)))

    @app.exception_handler(RequestRejected)
    async def rejected(request: Request, exc: RequestRejected):
        kind = "BadRequestError" if exc.status == 400 else "ServiceUnavailableError"
        return error_response(exc.status, str(exc), kind, exc.param)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, f"the engine is not available: {exc}", "ServiceUnavailableError")

    async def require_ready():
        """With several API servers, /health may answer 200 from one that is connected while this one is
        still finishing its handshake: a request waits a moment for it before the 503."""
        if not state["ready"]:
            try:
                await asyncio.wait_for(ready.wait(), READY_WAIT_S)
            except asyncio.TimeoutError:
                raise APIError(503, "the model is still loading", "ServiceUnavailableError") from None
        if llm.dead:
            raise APIError(503, f"the engine is not available: {llm.dead}", "ServiceUnavailableError")

    # ------------------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        if llm.dead or not state["ready"]:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        compute = state.get("compute")
        return {"version": nanoserve.__version__,
                "compute": None if compute is None else msgspec.structs.asdict(compute)}

    @app.get("/metrics")
    async def metrics_endpoint():
        body, content_type = Metrics.render()
        return Response(body, media_type=content_type)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "nanoserve",
                "root": settings.model_path, "max_model_len": state.get("max_model_len")}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in settings.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """The SDK's `client.models.retrieve`."""
        if model_id not in settings.served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", "NotFoundError", "model",
                           code="model_not_found")
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        await require_ready()
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        await require_ready()
        return await serving.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            ids = serving.chat_prompt(chat)[1]
        result = {"count": len(ids), "max_model_len": state.get("max_model_len"), "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    app.state.llm = llm
    app.state.serving = serving
    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket that every API-server process binds to the same port; the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_api_server(settings: ServerConfig) -> None:
    """Entry point of one API-server process."""
    import uvicorn

    from nanoserve.frontend.tokenizer import load_tokenizer

    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s api-{settings.index}[%(process)d] %(levelname)s %(message)s")
    sock = listening_socket(settings.host, settings.port)
    tokenizer = load_tokenizer(settings.model_path)
    if settings.chat_template:
        from nanoserve.templates import resolve_chat_template
        tokenizer.chat_template = resolve_chat_template(settings.chat_template)
    app = create_app(settings, tokenizer)
    config = uvicorn.Config(app, log_level=settings.log_level, timeout_graceful_shutdown=settings.drain_timeout,
                            access_log=False, timeout_keep_alive=settings.keep_alive_timeout)

    class DrainingServer(uvicorn.Server):
        """uvicorn cuts what is still in flight when its graceful shutdown times out (a broken chunked
        stream, a dropped connection); a little before that, the requests end themselves, in order."""

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                margin = min(1.0, settings.drain_timeout / 4)
                loop = asyncio.get_event_loop()
                loop.call_soon_threadsafe(loop.call_later, max(0.0, settings.drain_timeout - margin),
                                          app.state.serving.end_drain)
            super().handle_exit(sig, frame)

    DrainingServer(config).run(sockets=[sock])
