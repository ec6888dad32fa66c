"""`RequestLimits`: the API server's bounds on what a client may send, as plain ASGI middleware in front of
everything else: header count and size, X-Request-Id length (431), body size (413) and the time a body may
take to arrive (408), each answered in OpenAI's error shape before any handler runs."""
from __future__ import annotations

import asyncio

from nanoserve.config import ServerConfig
from nanoserve.entrypoints.openai.serving import error_response


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
        body, more = bytearray(), True
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
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await self.too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
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
