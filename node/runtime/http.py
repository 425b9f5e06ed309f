"""The node's local HTTP API (aiohttp): the status page at /, and /healthz, /status, /rounds, /rounds/{r},
/miners/{id}, /rewards, /metrics and POST /successor.

Read-only but for POST /successor, where an operator offers a signed successor document (`tessera spec offer`):
the node judges it at once and answers the verdict, and the offer changes nothing unless validators holding a
majority of weight signed the document. It binds 127.0.0.1 unless configured otherwise, every address of the host on one
port. Bad input gets a 4xx with a one-line JSON reason, never a 500: a non-numeric or absurd round
(400), an unknown round or miner (404), a refused successor (400), a query string over MAX_QUERY_CHARS as sent
(414), any other method (405); a request aiohttp cannot parse (a raw non-ASCII byte in the path, a line too long) gets
aiohttp's own plain-text 400 and one log line, no traceback. A view that fails (a storage error) gets a
500 with a one-line JSON reason, its traceback logged once. The page is three static files shipped in
node/runtime/page/ (no CDN, and a Content-Security-Policy that lets it load nothing from elsewhere); it
polls the JSON endpoints. It serves whatever a `StatusSource` (the running node's status views)
reports, so it knows nothing about rounds, storage or the network.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from node.runtime.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PAGE_DIR = Path(__file__).with_name("page")
PAGE_FILES = {"/": ("index.html", "text/html"), "/app.js": ("app.js", "text/javascript"),
              "/style.css": ("style.css", "text/css")}
MAX_QUERY_CHARS = 512
OFFER_PATH = "/successor"
MAX_ROUND_DIGITS = 12
_CSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:"


class StatusSource(Protocol):
    """What the API shows: a node's views as JSON-able values, and its metrics text."""

    async def status(self) -> dict[str, Any]: ...

    async def rewards(self) -> dict[str, Any]: ...

    async def rounds(self) -> list[dict[str, Any]]: ...

    async def round_report(self, round: int) -> dict[str, Any] | None: ...

    async def miner(self, miner: str) -> list[dict[str, Any]]: ...

    async def metrics_text(self) -> bytes: ...

    async def offer_successor(self, data: bytes) -> dict[str, Any]: ...


class HttpApi:
    """A running HTTP server; make it with `await HttpApi.start(...)`, stop it with `await close()`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port

    @classmethod
    async def start(cls, source: StatusSource, host: str = "127.0.0.1", port: int = 0) -> HttpApi:
        """Serve `source` on host:port (port 0 picks a free one; `.port` tells which)."""
        app = web.Application(middlewares=[_guard])
        app.add_routes([web.get(path, _static(name, kind)) for path, (name, kind) in PAGE_FILES.items()])
        app.add_routes([
            web.get("/healthz", _healthz),
            web.get("/status", _json(source.status)),
            web.get("/rewards", _json(source.rewards)),
            web.get("/metrics", _metrics(source)),
            web.get("/rounds", _json(source.rounds)),
            web.get("/rounds/{round}", _round(source)),
            web.get("/miners/{miner}", _miner(source)),
            web.post(OFFER_PATH, _offer(source)),
        ])
        logging.getLogger("aiohttp.server").addFilter(_BAD_REQUESTS)  # once: a filter is added only once
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            bound = await _listen(runner, host, port)
        except OSError as exc:
            await runner.cleanup()
            raise ValueError(f"http: cannot listen on {host}:{port}: {_why(exc)}") from exc
        return cls(runner, host, bound)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def _listen(runner: web.AppRunner, host: str, port: int) -> int:
    """Listen on every address `host` resolves to, all on one port, and return it. With port 0 the first
    address picks a free port and the others take the same: asyncio would give each its own ("localhost"
    is often both ::1 and 127.0.0.1), and the API could name only one of them."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)
    for address in dict.fromkeys(str(info[4][0]) for info in infos):
        await web.TCPSite(runner, address, port).start()
        port = runner.addresses[0][1]
    return port


def _why(exc: OSError) -> str:
    """What stopped a listen, in a few words: asyncio's message repeats the address."""
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (another node, or another program?); pick another port, or 0 for a free one"
    return os.strerror(exc.errno) if exc.errno else str(exc)


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


class _OneLineBadRequests(logging.Filter):
    """aiohttp answers a request it cannot parse (a raw non-ASCII byte in the path, a line too long) with a
    plain-text 400 and logs it with its traceback on `aiohttp.server`, so anyone who can connect could fill
    the log with tracebacks: such a record becomes one INFO line, or none where INFO is not logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, BadHttpMessage):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
            return False
        reason = " ".join(str(exc.message).split())[:100] or "unreadable"
        record.msg, record.args, record.exc_info = "http: refused a request it cannot parse: %s", (reason,), None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_BAD_REQUESTS = _OneLineBadRequests()


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what no endpoint takes before any handler runs; give every 4xx a JSON reason."""
    if len(request.rel_url.raw_query_string) > MAX_QUERY_CHARS:  # as sent: %41 is three characters
        return _error(414, f"query string over {MAX_QUERY_CHARS} characters")
    if request.method not in ("GET", "HEAD") and (request.method, request.path) != ("POST", OFFER_PATH):
        return _error(405, f"method {request.method[:16]} not allowed; this API is read-only (GET), but for "
                      f"POST {OFFER_PATH}")
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason)
    except Exception as exc:  # a failing view (a storage error): the traceback to the log, the client a JSON 500
        log.exception("http: %s %s failed", request.method, request.path[:200])
        return _error(500, f"internal error ({type(exc).__name__}) in the node; its log has the details")


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _json(fetch: Callable[[], Awaitable[Any]]) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(await fetch(), dumps=_dumps)

    return handler


def _round(source: StatusSource) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        text = request.match_info["round"]
        if not (text.isascii() and text.isdigit() and len(text) <= MAX_ROUND_DIGITS):
            return _error(400, f"round must be a non-negative integer, got {text[:20]!r}")
        report = await source.round_report(int(text))
        if report is None:
            return _error(404, f"no report for round {int(text)}")
        return web.json_response(report, dumps=_dumps)

    return handler


def _miner(source: StatusSource) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        miner = request.match_info["miner"]
        if not (len(miner) == 64 and all(c in "0123456789abcdef" for c in miner)):
            return _error(400, f"miner must be a 64-character lowercase hex node id, got {miner[:20]!r}")
        history = await source.miner(miner)
        if not history:
            return _error(404, f"no results for miner {miner[:12]} in the rounds this node keeps")
        return web.json_response(history, dumps=_dumps)

    return handler


def _offer(source: StatusSource) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        verdict = await source.offer_successor(await request.read())
        return web.json_response(verdict, status=200 if verdict["verdict"] == "accept" else 400, dumps=_dumps)

    return handler


def _metrics(source: StatusSource) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        response = web.Response(body=await source.metrics_text())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

    return handler


def _static(name: str, kind: str) -> Handler:
    body = (PAGE_DIR / name).read_bytes()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=kind, charset="utf-8",
                            headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"})

    return handler


def _dumps(value: object) -> str:
    return json.dumps(value, sort_keys=True, indent=2)
