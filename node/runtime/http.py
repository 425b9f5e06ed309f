"""The node's local HTTP API (aiohttp): /healthz, /status, /metrics, /rewards and a status page at /.

Read-only; binds 127.0.0.1 unless configured otherwise. It serves whatever a `StatusSource` (the
running node) reports, so it knows nothing about rounds, storage or the network itself.
"""

from __future__ import annotations

import html
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from aiohttp import web

from node.runtime.metrics import CONTENT_TYPE

Handler = Callable[[web.Request], Awaitable[web.Response]]
_TOP_STANDINGS = 20


class StatusSource(Protocol):
    """What the API shows: a node's status and rewards as JSON-able dicts, and its metrics text."""

    async def status(self) -> dict[str, Any]: ...

    async def rewards(self) -> dict[str, Any]: ...

    async def rounds(self) -> list[dict[str, Any]]: ...

    async def round_report(self, round: int) -> dict[str, Any] | None: ...

    def metrics_text(self) -> bytes: ...


class HttpApi:
    """A running HTTP server; make it with `await HttpApi.start(...)`, stop it with `await close()`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port

    @classmethod
    async def start(cls, source: StatusSource, host: str = "127.0.0.1", port: int = 0) -> HttpApi:
        """Serve `source` on host:port (port 0 picks a free one; `.port` tells which)."""
        app = web.Application()
        app.add_routes([
            web.get("/", _page(source)),
            web.get("/healthz", _healthz),
            web.get("/status", _json(source.status)),
            web.get("/rewards", _json(source.rewards)),
            web.get("/metrics", _metrics(source)),
            web.get("/rounds", _json(lambda: source.rounds())),
            web.get("/rounds/{round}", _round(source)),
        ])
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise ValueError(f"http: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        bound = runner.addresses[0][1]
        return cls(runner, host, bound)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _json(fetch: Callable[[], Awaitable[Any]]) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(await fetch(), dumps=_dumps)

    return handler


def _round(source: StatusSource) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        text = request.match_info["round"]
        if not (text.isascii() and text.isdigit()):
            raise web.HTTPNotFound(text=f"round must be a non-negative integer, got {text[:20]!r}")
        report = await source.round_report(int(text))
        if report is None:
            raise web.HTTPNotFound(text=f"no report for round {text}")
        return web.json_response(report, dumps=_dumps)

    return handler


def _metrics(source: StatusSource) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        response = web.Response(body=source.metrics_text())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

    return handler


def _page(source: StatusSource) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        status = await source.status()
        standings = (await source.rewards()).get("standings", {})
        rows = _rows(status.items())
        top = _rows(list(standings.items())[:_TOP_STANDINGS]) or "<tr><td>no rewards yet</td></tr>"
        body = _PAGE.format(role=html.escape(str(status.get("role", "node"))), rows=rows, standings=top)
        return web.Response(text=body, content_type="text/html")

    return handler


def _rows(items: Iterable[tuple[object, object]]) -> str:
    return "\n".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_cell(v))}</td></tr>" for k, v in items)


def _cell(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _dumps(value: object) -> str:
    return json.dumps(value, sort_keys=True, indent=2)


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>tessera {role}</title>
<style>body{{font-family:sans-serif;margin:2em}}th{{text-align:left;padding-right:1em}}
td{{font-family:monospace;word-break:break-all}}</style></head>
<body><h1>tessera {role}</h1>
<table>
{rows}
</table>
<h2>Standings</h2>
<table>
{standings}
</table>
<p><a href="/status">/status</a> · <a href="/rewards">/rewards</a> · <a href="/metrics">/metrics</a></p>
</body></html>
"""
