"""The HTTP API over real sockets: every endpoint answers a real request with what the node reports."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from node.net.network import NetworkStats
from node.runtime.http import HttpApi
from node.runtime.metrics import NodeMetrics, peer_label


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

    def metrics_text(self) -> bytes:
        return self.metrics.render()


@pytest.fixture
async def api() -> AsyncIterator[HttpApi]:
    server = await HttpApi.start(FakeNode(), "127.0.0.1", 0)
    yield server
    await server.close()


async def get(url: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, response.headers["Content-Type"], await response.text()


async def test_binds_loopback_on_a_free_port(api: HttpApi) -> None:
    assert api.port > 0 and api.url == f"http://127.0.0.1:{api.port}"
    status, _, body = await get(f"{api.url}/healthz")
    assert status == 200 and '"ok": true' in body


async def test_status_and_rewards_are_json(api: HttpApi) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{api.url}/status") as response:
            assert response.status == 200
            status = await response.json()
        async with session.get(f"{api.url}/rewards") as response:
            rewards = await response.json()
    assert status["role"] == "validator" and status["round"] == 7 and status["peers"] == 4
    assert rewards["standings"] == {"m": 0.3} and rewards["entries"][0]["points"] == 1.0


async def test_metrics_exposition(api: HttpApi) -> None:
    status, content_type, text = await get(f"{api.url}/metrics")
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


async def test_status_page_escapes_values(api: HttpApi) -> None:
    status, content_type, body = await get(f"{api.url}/")
    assert status == 200 and content_type.startswith("text/html")
    assert "<title>tessera validator</title>" in body
    assert "&lt;script&gt;x&lt;/script&gt;" in body and "<script>" not in body
    assert "<tr><th>m</th><td>0.3</td></tr>" in body  # standings, best first


async def test_unknown_path_is_404(api: HttpApi) -> None:
    status, _, _ = await get(f"{api.url}/nope")
    assert status == 404


async def test_port_in_use_is_a_clear_error(api: HttpApi) -> None:
    with pytest.raises(ValueError, match=f"http: cannot listen on 127.0.0.1:{api.port}"):
        await HttpApi.start(FakeNode(), "127.0.0.1", api.port)


def test_peer_labels_are_bounded() -> None:
    assert peer_label("12D3KooWAbcdefghijklmnop") == "12D3KooWAbcdefgh"
    assert peer_label('x"}\n' * 10) == "invalid"
    assert peer_label("short") == "invalid"
