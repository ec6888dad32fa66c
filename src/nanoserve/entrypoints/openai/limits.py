"""`RequestLimits`: the API server's bounds on what a client may send, as ASGI middleware in front of all:
headers (431), body size and structure (413), body arrival time (408), in OpenAI's error shape before any
handler runs. The body it read reaches the routes without another copy (`PreReadRoute`)."""
from __future__ import annotations

import asyncio
import json

import msgspec
from fastapi import Request
from fastapi.routing import APIRoute

from nanoserve.config import ServerConfig
from nanoserve.entrypoints.openai.serving import error_response

BODY_SCOPE_KEY = "nanoserve.body"  # the request body RequestLimits read, as bytes
LARGE_BODY_BYTES = 1 << 20  # joined on a worker thread (bytes.join lets go of the GIL), parsed after a yield


class RequestLimits:
    def __init__(self, app, settings: ServerConfig):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        problem = self.header_problem(scope["headers"])
        if problem is not None:
            return await error_response(431, problem, "RequestHeaderFieldsTooLarge")(scope, receive, send)
        limit = self.settings.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await self.too_large(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # The whole body first, bounded in size and time; the handler then reads it from memory and, after
        # it, the client's own channel (so that it still sees a disconnect).
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.settings.body_read_timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await error_response(
                    408, f"the request body did not arrive within {self.settings.body_read_timeout:g} s",
                    "RequestTimeout")(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                return await self.too_large(scope, receive, send)
        # Copying 32 MiB into fresh pages took this VM ~150 ms, twice more in Starlette: one copy, off the loop.
        body = await asyncio.to_thread(b"".join, chunks) if size > LARGE_BODY_BYTES else b"".join(chunks)
        if size > LARGE_BODY_BYTES:
            # Parsing builds a Python object per container and per key: 4.6M lists (27 MiB) took 3 s on the
            # event loop, a logit_bias of 1M keys 1.3 s. An upper bound (brackets in strings count too), in ms.
            # Plain items (numbers, strings) cost ~1/16 of that each: commas count for 1/16.
            nodes = body.count(b"{") + body.count(b"[") + body.count(b":") + body.count(b",") // 16
            if nodes > self.settings.max_json_nodes:
                return await error_response(
                    413, f"the request body has up to {nodes} JSON nodes (counting '{{', '[' and ':' as one, "
                    f"',' as 1/16); at most {self.settings.max_json_nodes} are accepted", "RequestTooLarge")(
                    scope, receive, send)
        scope[BODY_SCOPE_KEY] = body
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def header_problem(self, headers) -> str | None:
        s = self.settings
        if len(headers) > s.max_headers:
            return f"{len(headers)} request headers; at most {s.max_headers} are accepted"
        size = sum(len(k) + len(v) for k, v in headers)
        if size > s.max_header_bytes:
            return f"request headers of {size} bytes; at most {s.max_header_bytes} are accepted"
        for k, v in headers:
            if k == b"x-request-id" and len(v) > s.max_request_id_length:
                return f"X-Request-Id of {len(v)} characters; at most {s.max_request_id_length} are accepted"
        return None

    async def too_large(self, scope, receive, send):
        await error_response(413, f"the request body is larger than {self.settings.max_body_bytes} bytes",
                             "RequestTooLarge")(scope, receive, send)


class PreReadRequest(Request):
    """A request whose body RequestLimits already read: `body()` is that object (Starlette would copy it
    again). `json()` parses with msgspec, from the bytes (half the time of `json.loads`, which decodes the
    UTF-8 to a str first), a large body after giving the event loop a turn."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            pre_read = self.scope.get(BODY_SCOPE_KEY)
            self._body = pre_read if pre_read is not None else await super().body()
        return self._body

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > LARGE_BODY_BYTES:
                await asyncio.sleep(0)
            try:
                self._json = msgspec.json.decode(body)
            except msgspec.DecodeError as exc:  # FastAPI answers a JSONDecodeError as a malformed body
                raise json.JSONDecodeError(str(exc), "", 0) from None
        return self._json


class PreReadRoute(APIRoute):
    """The app's route class: its handlers get a PreReadRequest."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def pre_read_handler(request: Request):
            return await handler(PreReadRequest(request.scope, request.receive))

        return pre_read_handler
