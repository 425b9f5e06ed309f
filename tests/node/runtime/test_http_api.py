"""The HTTP API over real sockets: every endpoint answers a real request with what the node reports, the
status page is served from the package with nothing to load from elsewhere, and bad input gets a
4xx with a short JSON reason, never a 500."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from node.net.network import NetworkStats
from node.runtime.config import HttpSection
from node.runtime.http import MAX_QUERY_CHARS, PAGE_DIR, HttpApi
from node.runtime.metrics import NodeMetrics, peer_label
from node.store.records import StorageError

MINER = "ab" * 32
ROUND = {"round": 3, "source": "public", "base": "cd" * 32, "base_loss": 2.5, "global_hash": None,
         "global_loss": 2.25, "miners": [{"id": MINER, "verdict": "accept", "loss": 2.4, "rank": 1,
                                          "reward": 1.0, "reason": "", "scores": {}}]}


class FakeNode:
    def __init__(self) -> None:
        self.metrics = NodeMetrics(top_peers=2)
        self.stats = NetworkStats(
            messages=Counter({("commit", "accept"): 3, ("commit", "reject"): 2}),
            rejects_by_peer=Counter({"a" * 64: 5, "b" * 64: 3, "c" * 64: 1, "d" * 64: 1}),
            gossip_bytes_in=1234,
        )
        self.metrics.bind_network(lambda: self.stats, lambda: 4)
        self.metrics.phase_run(7, "train", 1.5, 0.25, ok=False)

    async def status(self) -> dict[str, Any]:
        return {"role": "validator", "round": 7, "phase": "train", "peers": 4, "note": "<script>x</script>"}

    async def rewards(self) -> dict[str, Any]:
        return {"entries": [{"round": 1, "miner": "m", "points": 1.0}], "standings": {"m": 0.3}}

    async def rounds(self) -> list[dict[str, Any]]:
        return [ROUND]

    async def round_report(self, round: int) -> dict[str, Any] | None:
        return ROUND if round == 3 else None

    async def miner(self, miner: str) -> list[dict[str, Any]]:
        return [{"round": 3, **ROUND["miners"][0]}] if miner == MINER else []

    async def metrics_text(self) -> bytes:
        return self.metrics.render()


@pytest.fixture
async def api() -> AsyncIterator[HttpApi]:
    server = await HttpApi.start(FakeNode())  # the defaults: loopback, a free port
    yield server
    await server.close()


async def request(url: str, method: str = "GET") -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.request(method, url) as response:
        return response.status, response.headers.get("Content-Type", ""), await response.text()


async def test_binds_loopback_on_a_free_port(api: HttpApi) -> None:
    assert api.port > 0 and api.url == f"http://127.0.0.1:{api.port}"
    assert HttpSection().host == "127.0.0.1"  # a node's config binds loopback unless told otherwise
    status, _, body = await request(f"{api.url}/healthz")
    assert status == 200 and '"ok": true' in body


async def test_json_endpoints(api: HttpApi) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{api.url}/status") as response:
            assert response.status == 200
            status = await response.json()
        async with session.get(f"{api.url}/rewards") as response:
            rewards = await response.json()
        async with session.get(f"{api.url}/rounds") as response:
            rounds = await response.json()
        async with session.get(f"{api.url}/rounds/3") as response:
            one = await response.json()
        async with session.get(f"{api.url}/miners/{MINER}") as response:
            history = await response.json()
    assert status["role"] == "validator" and status["round"] == 7 and status["peers"] == 4
    assert rewards["standings"] == {"m": 0.3} and rewards["entries"][0]["points"] == 1.0
    assert rounds == [ROUND] and one == ROUND
    assert history == [{"round": 3, **ROUND["miners"][0]}]


async def test_metrics_exposition(api: HttpApi) -> None:
    status, content_type, text = await request(f"{api.url}/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    assert 'tessera_messages_total{kind="commit",verdict="accept"} 3.0' in text
    assert 'tessera_bytes_total{channel="gossip",direction="in"} 1234.0' in text
    assert "tessera_peers 4.0" in text
    assert "tessera_round 7.0" in text
    assert 'tessera_phase_failures_total{phase="train"} 1.0' in text
    assert 'tessera_phase_duration_seconds_count{phase="train"} 1.0' in text
    # top 2 peers by rejects, the rest folded into "other"
    assert f'tessera_peer_rejects_total{{peer="{peer_label("a" * 64)}"}} 5.0' in text
    assert f'tessera_peer_rejects_total{{peer="{peer_label("b" * 64)}"}} 3.0' in text
    assert 'tessera_peer_rejects_total{peer="other"} 2.0' in text
    assert "c" * 16 not in text


async def test_the_status_page_loads_nothing_from_elsewhere(api: HttpApi) -> None:
    status, content_type, page = await request(f"{api.url}/")
    assert status == 200 and content_type.startswith("text/html")
    linked = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert "/app.js" in linked and "/style.css" in linked
    assert all(url.startswith("/") for url in linked), linked
    for asset, kind in (("/app.js", "text/javascript"), ("/style.css", "text/css")):
        status, content_type, body = await request(f"{api.url}{asset}")
        assert status == 200 and content_type.startswith(kind)
        assert body == (PAGE_DIR / asset.lstrip("/")).read_text(encoding="utf-8")
    script = (PAGE_DIR / "app.js").read_text(encoding="utf-8")
    assert "innerHTML" not in script  # node data goes in as text, never as markup
    assert set(re.findall(r'getJSON\("([^"]+)"\)', script)) == {"/status", "/rounds", "/rewards"}
    async with aiohttp.ClientSession() as session, session.get(f"{api.url}/") as response:
        policy = response.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("GET", "/rounds/7", 404),
    ("GET", "/rounds/abc", 400),
    ("GET", "/rounds/-1", 400),
    ("GET", "/rounds/1e3", 400),
    ("GET", "/rounds/" + "9" * 5000, 400),  # int() of this many digits raises; must not become a 500
    ("GET", "/rounds/%F0%9F%98%80", 400),
    ("GET", "/miners/xyz", 400),
    ("GET", "/miners/" + "AB" * 32, 400),
    ("GET", "/miners/" + "ef" * 32, 404),
    ("GET", "/status?" + "x=1&" * MAX_QUERY_CHARS, 414),
    ("GET", "/nope", 404),
    ("POST", "/status", 405),
    ("POST", "/", 405),
    ("PUT", "/rounds/3", 405),
    ("DELETE", "/metrics", 405),
    ("POST", "/nope", 405),
])
async def test_bad_input_gets_a_4xx_with_a_short_reason(api: HttpApi, method: str, path: str,
                                                        expected: int) -> None:
    async with aiohttp.ClientSession() as session, session.request(method, f"{api.url}{path}") as response:
        assert response.status == expected, await response.text()
        body = await response.json()
    assert set(body) == {"error"} and 0 < len(body["error"]) <= 120, body


async def test_an_oversized_request_line_is_refused(api: HttpApi) -> None:
    status, _, _ = await request(f"{api.url}/status?{'y' * 20_000}")
    assert 400 <= status < 500


async def test_port_in_use_is_a_clear_error(api: HttpApi) -> None:
    with pytest.raises(ValueError, match=f"http: cannot listen on 127.0.0.1:{api.port}"):
        await HttpApi.start(FakeNode(), "127.0.0.1", api.port)


async def test_a_host_of_two_addresses_listens_on_one_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """"localhost" is often both ::1 and 127.0.0.1; with port 0 each would get its own free port."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def both(host: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "localhost":
            return await real(host, *args, **kwargs)
        return [*await real("::1", *args, **kwargs), *await real("127.0.0.1", *args, **kwargs)]

    monkeypatch.setattr(loop, "getaddrinfo", both)
    try:
        server = await HttpApi.start(FakeNode(), "localhost", 0)
    except ValueError as exc:  # no IPv6 loopback here
        pytest.skip(str(exc))
    try:
        assert server.url == f"http://localhost:{server.port}"
        for address in ("[::1]", "127.0.0.1"):
            status, _, _ = await request(f"http://{address}:{server.port}/healthz")
            assert status == 200, address
    finally:
        await server.close()


class FailingNode(FakeNode):
    async def rewards(self) -> dict[str, Any]:
        raise StorageError("database disk image is malformed\nat /var/lib/tessera/node.db")


async def test_a_failing_view_gets_a_json_500_and_one_logged_traceback(caplog: pytest.LogCaptureFixture) -> None:
    server = await HttpApi.start(FailingNode())
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{server.url}/rewards") as response:
            assert response.status == 500 and response.content_type == "application/json"
            body = await response.json()
        status, _, _ = await request(f"{server.url}/status")  # the others still answer
    finally:
        await server.close()
    assert status == 200
    assert set(body) == {"error"} and "StorageError" in body["error"] and "\n" not in body["error"], body
    assert "/var/lib" not in body["error"]  # details go to the node's log, not to whoever asks
    logged = [r for r in caplog.records if r.exc_info is not None]
    assert len(logged) == 1 and "/rewards" in logged[0].getMessage()


def test_peer_labels_are_bounded() -> None:
    assert peer_label("12D3KooWAbcdefghijklmnop") == "12D3KooWAbcdefgh"
    assert peer_label('x"}\n' * 10) == "invalid"
    assert peer_label("short") == "invalid"


async def raw_request(api: HttpApi, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
    writer.write(data)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def test_a_request_aiohttp_cannot_parse_gets_a_400_and_one_log_line_without_a_traceback(
    api: HttpApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    answer = await raw_request(api, b"GET /rounds/\xd9\xa3 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], answer
    assert not [r for r in caplog.records if r.exc_info is not None]
    said = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(said) == 1 and said[0].levelname == "INFO", [r.getMessage() for r in said]
    assert said[0].getMessage().startswith("http: refused a request it cannot parse: Invalid char in url path")
    caplog.clear()
    caplog.set_level("WARNING")  # a node that logs warnings only: not a line
    await raw_request(api, b"GET /rounds/\xd9\xa3 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [r for r in caplog.records if r.name == "aiohttp.server"] == []
    status, _, _ = await request(f"{api.url}/healthz")  # the server still answers
    assert status == 200


async def test_the_query_string_is_measured_as_sent(api: HttpApi) -> None:
    for query, expected in (("%41" * 400, b" 414 "), ("%41" * (MAX_QUERY_CHARS // 3), b" 200 ")):  # 1,200 sent
        answer = await raw_request(api, f"GET /status?{query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        assert expected in answer.split(b"\r\n")[0], answer[:200]
