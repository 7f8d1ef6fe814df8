"""Stand-ins for the real web services on 127.0.0.1: for the tests and `python -m mgrpo_jax.bench.env --judge=http`.

`LoopbackServer(handler)` serves `handler(request) -> Reply` from daemon threads on a free port of 127.0.0.1, as a
context manager. It answers at most `max_requests` requests (503 after that, so a retry loop gone wrong ends) and
records every request it got (`requests`: method, path, query, headers, body). Handlers:

  world_services(backend)  a search API (`GET /search?q=&k=`) and a page reader (`GET /read?url=`) over a
                           `WebBackend` (the offline world's), in the formats `HttpSearchBackend` / `HttpPageBackend`
                           read;
  chat_judge(verdict)      an OpenAI-compatible `POST /v1/chat/completions` whose reply is `verdict(system, user)`.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: Any = b""  # bytes, str, or anything JSON-serialisable
    content_type: str = "application/json"
    delay_s: float = 0.0  # wait this long before answering (a slow service)
    headers: dict[str, str] = field(default_factory=dict)  # e.g. {"Retry-After": "2"}

    def encoded(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return self.body.encode() if isinstance(self.body, str) else json.dumps(self.body).encode()


Handler = Callable[[Request], Reply]


@dataclass
class LoopbackServer:
    handler: Handler
    max_requests: int = 10_000
    requests: list[Request] = field(default_factory=list)

    def __enter__(self) -> LoopbackServer:
        owner = self

        class _Handler(BaseHTTPRequestHandler):
            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                parsed = urllib.parse.urlsplit(self.path)
                request = Request(self.command, parsed.path, dict(urllib.parse.parse_qsl(parsed.query)),
                                  dict(self.headers.items()), self.rfile.read(length) if length else b"")
                with owner._lock:
                    owner.requests.append(request)
                    over = len(owner.requests) > owner.max_requests
                reply = Reply(503, {"error": "over the request limit"}) if over else owner.handler(request)
                time.sleep(reply.delay_s)
                body = reply.encoded()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", reply.content_type)
                    self.send_header("Content-Length", str(len(body)))
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            do_GET = do_POST = _serve  # noqa: N815 (http.server's naming)

            def log_message(self, *args):
                pass

        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"


def world_services(backend) -> Handler:
    """A search API at /search and a page reader at /read over `backend` (anything with `search` and `visit`)."""

    def handle(request: Request) -> Reply:
        if request.path == "/search":
            hits = backend.search(request.query.get("q", ""), int(request.query.get("k", "5")))
            return Reply(body={"results": [{"title": h.title, "url": h.url, "snippet": h.snippet} for h in hits]})
        if request.path == "/read":
            page = backend.visit(request.query.get("url", ""))
            return Reply(404, b"") if page is None else Reply(body={"title": page.title, "text": page.text})
        return Reply(404, b"")

    return handle


def chat_reply(text: str) -> dict:
    """A chat-completions response body carrying `text`."""
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}


def chat_judge(verdict: Callable[[str, str], str]) -> Handler:
    """An OpenAI-compatible /v1/chat/completions answering `verdict(system message, user message)`."""

    def handle(request: Request) -> Reply:
        if request.method != "POST" or request.path != "/v1/chat/completions":
            return Reply(404, b"")
        messages = {m["role"]: m["content"] for m in request.json()["messages"]}
        return Reply(body=chat_reply(verdict(messages.get("system", ""), messages.get("user", ""))))

    return handle
