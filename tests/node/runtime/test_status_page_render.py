"""The status page's script against a fake node in headless Chromium, in seconds: what peers chose (a
reason, a network name) is shown as text and never run as markup, standings are ordered best first,
a validator's page shows any miner's history from its link, the header says how the network learns,
a failing node shows an error instead of stale numbers, leaderboards of rounds the node no longer
serves go, a node whose key another node uses says so, and so do a validator outvoted on a round's state
and a node whose disk is short of room; the page names the release and protocol version and says when peers on
another protocol version were refused. The page on a real simulation is checked in tests/integration/test_network.py."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.runtime.http import HttpApi

pytestmark = pytest.mark.slow

# The page polls the node every POLL_MS; a test that changes the node moves the page's clock on by that much
# (Playwright's fake timers, installed before the page loads) rather than waiting for the next poll.
APP = Path(__file__).parents[3] / "node" / "runtime" / "page" / "app.js"
POLL_MS = int(re.findall(r"^const POLL_MS = (\d+);", APP.read_text(encoding="utf-8"), re.M)[0])

EVIL = '<img src=x onerror="document.body.dataset.pwned=1">'
A, B = "aa" * 32, "bb" * 32
V = "cc" * 32
ENTRY = {"verdict": "reject", "loss": None, "rank": None, "reward": 0.0, "reason": f"rejected: {EVIL}",
         "scores": {V: {"verdict": "reject", "loss": None, "reason": EVIL}}}
ROUNDS = [{"round": 0, "source": "validator", "base": "dd" * 32, "base_loss": 3.0, "global_hash": "ee" * 32,
           "global_loss": 2.5, "miners": [{"id": A, "verdict": "accept", "loss": 2.4, "rank": 1, "reward": 1.0,
                                           "reason": "", "scores": {V: {"verdict": "accept", "loss": 2.4}}},
                                          {"id": B, **ENTRY}]}]

LEARNING = {"format": "pgrad", "pgrad": {"chunk": 256, "topk": 40, "quant": "2bit", "partitions": 2}, "experts": 4,
            "inner_steps": 5, "inner_lr": 0.001, "inner_beta1": 0.656, "batch_size": 8, "top_g": 8, "outer_lr": 2.5, "momentum": 0.0,
            "weighting": "uniform"}


class FakeValidator:
    def __init__(self) -> None:
        self.broken = False
        self.key_used_elsewhere: dict[str, Any] | None = None
        self.clock_behind: dict[str, Any] | None = None
        self.outvoted: dict[str, Any] | None = None
        self.disk: dict[str, Any] = {"path": "/srv/tessera/data", "free_bytes": 50 << 30, "needed_bytes": 6 << 20,
                                     "low": False, "refused": None}
        self.protocol_alert: str | None = None
        self.hold = threading.Event()  # cleared: /status answers only once it is set again
        self.hold.set()
        self.in_flight = self.most_in_flight = 0
        self.rounds_shown = ROUNDS
        self.learning = LEARNING
        self.spec: dict[str, Any] = {"id": "aa" * 32, "since_round": 0, "group": {"0": [1, 5], "1": [2, 6]},
                                     "successor": None}

    async def status(self) -> dict[str, Any]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            while not self.hold.is_set():
                await asyncio.sleep(0.01)
        finally:
            self.in_flight -= 1
        if self.broken:
            raise RuntimeError("storage is gone")
        return {"role": "validator", "node_id": V, "network": EVIL, "network_id": "ff" * 32, "round": 1,
                "phase": "train", "peers": 2, "head": "ee" * 32, "head_round": 0, "me": None,
                "agreement": {"round": 0, "share": 1.0}, "next_phase": {"round": 1, "phase": "commit", "in_s": 65},
                "learning": self.learning, "key_used_elsewhere": self.key_used_elsewhere,
                "clock_behind": self.clock_behind, "outvoted": self.outvoted, "disk": self.disk, "version": "9.8.7",
                "protocol": 5, "protocol_alert": self.protocol_alert, "spec": self.spec}

    async def rewards(self) -> dict[str, Any]:
        return {"entries": [], "standings": {B: 0.1, A: 0.3}}

    async def rounds(self) -> list[dict[str, Any]]:
        return self.rounds_shown

    async def round_report(self, round: int) -> dict[str, Any] | None:
        return ROUNDS[0] if round == 0 else None

    async def miner(self, miner: str) -> list[dict[str, Any]]:
        return [{"round": 0, **m} for m in ROUNDS[0]["miners"] if m["id"] == miner]

    async def metrics_text(self) -> bytes:
        return b""

    async def offer_successor(self, data: bytes) -> dict[str, Any]:
        return {"verdict": "refuse", "reason": "not in this test"}


@pytest.fixture
def served() -> Iterator[tuple[HttpApi, FakeValidator]]:
    """The API on an event loop of its own thread: Playwright's sync API runs its own loop in this one."""
    node = FakeValidator()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    api = asyncio.run_coroutine_threadsafe(HttpApi.start(node), loop).result(10)
    try:
        yield api, node
    finally:
        asyncio.run_coroutine_threadsafe(api.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_page_renders_peer_text_as_text(browser: Any, served: tuple[HttpApi, FakeValidator]) -> None:
    api, node = served
    page = browser.new_page()
    _ready(page, api.url)
    assert page.locator("#subtitle").inner_text().endswith(f"network {EVIL} (ffffffffffff)")
    row = page.locator(f"tr[data-miner='{B}'] td.reason")
    assert row.inner_text() == f"rejected: {EVIL}"
    assert page.locator("img").count() == 0 and page.evaluate("document.body.dataset.pwned") is None
    assert page.eval_on_selector_all("#standings tr[data-miner]", "r => r.map(e => e.dataset.miner)") == [A, B]
    assert page.locator("#countdown").inner_text().startswith("commit of round 1 in 1:0")
    assert page.locator("#me").is_hidden()
    assert page.locator("#learning").inner_text() == (
        "4 experts · 5 AdamW steps a round (lr 0.001, beta1 0.656, batch 8) · miners send compressed "
        "pseudo-gradients (40 of 256 entries a chunk, 2bit, 1/2 of the chunks) · top 8 merged, "
        "outer lr 2.5, momentum 0, uniform weights")

    page.locator(f"table.leaderboard tr[data-miner='{B}']").click()  # a miner's history on a validator
    page.wait_for_selector("#me:not([hidden]) tr.my-round[data-round='0']")
    assert page.locator("#me-title").inner_text() == f"Miner {B[:12]}"
    assert page.locator("tr.my-round td.reason").inner_text() == f"rejected: {EVIL}"

    assert page.locator("#spec").inner_text() == "expert group layer 0: 1 5 · layer 1: 2 6"
    assert page.locator("#successor").is_hidden()
    node.spec = {"id": "bb" * 32, "since_round": 3, "group": {"0": [3, 7], "1": [0, 4]}, "successor": {
        "document": "cc" * 32, "activation": 9, "in_s": 7800.0, "signed_by": 2, "validators": 3,
        "group": {"0": [2], "1": [5]}}}
    _next_poll(page)
    page.wait_for_selector("#successor:not([hidden])", timeout=10_000)
    assert page.locator("#spec").inner_text() == ("expert group layer 0: 3 7 · layer 1: 0 4 (successor spec "
                                                  "bbbbbbbbbbbb, since round 3)")
    assert page.locator("#successor").inner_text() == (
        "Expert group changes at round 9, in 2 h 10 min; signed by 2 of 3 validators (next group: layer 0: 2 · "
        "layer 1: 5).")

    assert page.locator("#key-alert").is_hidden()
    node.key_used_elsewhere = {"messages": 2, "last_kind": "commit", "last_round": 1}
    _next_poll(page)
    page.wait_for_selector("#key-alert:not([hidden])", timeout=10_000)
    assert page.locator("#key-alert").inner_text() == (
        "Another node is running with this node's key: 2 message(s) signed with it reached this node that it "
        "did not send (the last a commit of round 1). Stop one of them, or give each its own key.")
    assert page.locator("#clock-alert").is_hidden()
    node.clock_behind = {"early_validators": 3, "behind_by_at_least_s": 42.5}
    _next_poll(page)
    page.wait_for_selector("#clock-alert:not([hidden])", timeout=10_000)
    assert page.locator("#clock-alert").inner_text() == (
        "This node's clock is probably at least 42.5 s behind: messages from 3 validator(s) arrived before their "
        "windows opened. Peers judge this node's messages by their clocks; check that this machine keeps time (NTP).")
    assert page.locator("#outvote-alert").is_hidden()
    node.outvoted = {"round": 3, "mine": "merged", "majority": "best_single", "state": "ab" * 32, "gain": -3.8e-9,
                     "margin": 1e-4}
    _next_poll(page)
    page.wait_for_selector("#outvote-alert:not([hidden])", timeout=10_000)
    assert page.locator("#outvote-alert").inner_text() == (
        "Outvoted in round 3: this validator's merge gate adopted the merged state, validators holding a majority "
        "of weight the best_single state abababababab (here it measured -3.8e-9 nats against ours; a change needs "
        "a gain whose interval clears 0.0001 nats). This node follows the majority's state.")
    assert page.locator("#disk-alert").is_hidden()
    node.disk = {**node.disk, "free_bytes": 0, "low": True,
                 "refused": {"round": 1, "error": "database or disk is full"}}
    _next_poll(page)
    page.wait_for_selector("#disk-alert:not([hidden])", timeout=10_000)
    assert page.locator("#disk-alert").inner_text() == (
        "A full disk refused a write in round 1 (database or disk is full). The disk of /srv/tessera/data has 0 B "
        "free, and the rounds ahead need about 6.0 MiB: free space there or move node.data_dir to a larger disk. "
        "The node goes on, and catches up once there is room.")
    node.disk = {**node.disk, "free_bytes": 64 << 20, "low": False, "refused": None}  # room again
    _next_poll(page)
    page.wait_for_selector("#disk-alert[hidden]", state="attached", timeout=10_000)

    assert page.locator("#version").inner_text() == "tessera 9.8.7 · protocol 5"
    assert page.locator("#protocol-alert").is_hidden()
    node.protocol_alert = "2 peers speak protocol 6; this node speaks 5: upgrade"
    _next_poll(page)
    page.wait_for_selector("#protocol-alert:not([hidden])", timeout=10_000)
    assert page.locator("#protocol-alert").inner_text() == (
        "2 peers speak protocol 6; this node speaks 5: upgrade (peers on another protocol version are refused).")

    node.broken = True
    _next_poll(page)
    page.wait_for_selector("#error:not([hidden])", timeout=10_000)
    assert page.locator("#error").inner_text().startswith("cannot reach the node: /status: HTTP 500")
    page.close()


def test_a_slow_node_is_polled_once_at_a_time(browser: Any, served: tuple[HttpApi, FakeValidator]) -> None:
    """A node slower to answer than the poll interval must not be sent a new set of requests at every tick."""
    api, node = served
    page = browser.new_page()
    _ready(page, api.url)
    node.hold.clear()
    page.clock.run_for(3 * POLL_MS + 1_000)  # three polls' worth while the first is still waiting
    page.wait_for_timeout(500)
    node.hold.set()
    page.wait_for_timeout(500)
    assert node.most_in_flight == 1
    page.close()


def test_a_node_gone_quiet_leaves_no_live_looking_numbers(browser: Any, served: tuple[HttpApi, FakeValidator]) -> None:
    """When the node stops answering, the countdown stops and the last numbers are marked as stale."""
    api, node = served
    page = browser.new_page()
    _ready(page, api.url)
    assert page.locator("main.stale").count() == 0
    node.broken = True
    _next_poll(page)
    page.wait_for_selector("#error:not([hidden])", timeout=10_000)
    assert page.locator("main.stale").count() == 1
    assert page.locator("#countdown").inner_text() == "—"
    node.broken = False
    _next_poll(page)
    page.wait_for_selector("#error[hidden]", state="attached", timeout=10_000)
    assert page.locator("main.stale").count() == 0
    assert page.locator("#countdown").inner_text().startswith("commit of round 1 in")
    page.close()


def test_leaderboards_go_when_no_round_shown_has_miners(browser: Any, served: tuple[HttpApi, FakeValidator]) -> None:
    """Once the rounds the node serves have no miners (the window moved past the last scored round), the
    tables of earlier polls must not stay on screen as if current."""
    api, node = served
    page = browser.new_page()
    _ready(page, api.url)
    assert page.locator("table.leaderboard").count() == 1
    node.rounds_shown = [{**ROUNDS[0], "round": 40, "miners": []}]
    _next_poll(page)
    page.wait_for_selector("#leaderboards > p.muted", timeout=10_000)
    assert page.locator("table.leaderboard").count() == 0
    assert page.locator("#leaderboards").inner_text() == "no scored round yet"
    page.close()


def _ready(page: Any, url: str) -> None:
    page.clock.install()
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=10_000)


def _next_poll(page: Any) -> None:
    """Run the page's timers one poll interval on: the page asks the node again now."""
    page.clock.run_for(POLL_MS)
