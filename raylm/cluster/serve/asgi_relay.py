"""Run one HTTP request through an ASGI app in this process and stream back its ASGI messages: how a Serve replica
answers a request that an ingress deployment relays to it (raylm/cluster/serve/lora_serve.py), with the same FastAPI app
that serves it directly. Closing the stream before the end is the client's disconnect."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass
class RelayedRequest:
    """What an ingress forwards of an HTTP request."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


async def relay(app: ASGIApp, request: RelayedRequest,
                extra_headers: list[tuple[bytes, bytes]] = ()) -> AsyncGenerator[Message, None]:  # type: ignore[assignment]
    """The app's "http.response.start" and "http.response.body" messages for `request`; `extra_headers` join the
    response's headers."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra_headers]}
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        await task  # the app's own error, if it raised before answering
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _scope(request: RelayedRequest) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": request.query_string, "headers": list(request.headers), "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80)}
