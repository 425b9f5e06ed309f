"""The status page and /metrics of nodes in a running simulation (1 validator, 2 miners, real processes
over loopback libp2p), after two completed rounds.

Headless Chromium (Debian's package, which the Makefile installs) loads the validator's and a miner's
status page through Playwright; the rendered DOM must show one loss-chart point per completed
round, the round's miners in the leaderboard, and on the miner's page its own rank and reward as the
validator decided them (the miner ranks the round itself from the public score reports). Both
nodes' /metrics, parsed with prometheus-client's parser, must hold every metric the operator alerts
on with sensible values. A screenshot goes under the test's tmp dir (and /work/notes when that
exists, for the lead's notes).
"""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.sim.run import SimSettings, Simulation

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
NOTES = Path("/work/notes")
ROUNDS = 2


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] from a node's /metrics, parsed by prometheus-client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    matching = [v for got, v in samples.get(name, []) if all(got.get(k) == want for k, want in labels.items())]
    assert matching, f"{name}{labels or ''} missing; have {sorted(samples)}"
    return sum(matching)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("status-page") / "sim"
    settings = SimSettings(validators=1, miners=2, round_seconds=40, train_share=0.6, start_delay_s=50)
    with Simulation(directory, settings) as simulation:
        simulation.start()
        yield simulation


@pytest.fixture(scope="module")
def completed(sim: Simulation) -> list[dict]:
    """The validator's reports of the first ROUNDS rounds that completed (a node slow to start on a busy
    machine can miss round 0: that round then has no seed and no report, and a later one counts)."""

    def done() -> list[dict] | None:
        finished = [r for r in sim.get("validator-0", "/rounds") or [] if r["global_loss"] is not None]
        return finished[:ROUNDS] if len(finished) >= ROUNDS else None

    return sim.wait_until(done, 50 + 5 * 40, f"{ROUNDS} completed rounds")


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (make test installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


def test_the_status_pages_show_the_network_learning_and_a_miners_results(sim: Simulation, completed: list[dict],
                                                                         browser, tmp_path: Path) -> None:
    validator, miner = sim.nodes["validator-0"], sim.nodes["miner-0"]
    reports = completed

    page = browser.new_page(viewport={"width": 1100, "height": 1400})
    page.goto(f"http://127.0.0.1:{validator.http_port}/")
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)
    rounds = sim.get(validator.name, "/rounds")
    done = {r["round"] for r in rounds if r["global_loss"] is not None}
    points = page.eval_on_selector_all("#loss-chart circle.point", "els => els.map(e => Number(e.dataset.round))")
    assert sorted(points) == sorted(done) and {r["round"] for r in reports} <= done, (points, done)

    latest = reports[-1]
    board = page.locator(f"table.leaderboard[data-round='{latest['round']}'] tr[data-miner]")
    assert sorted(board.evaluate_all("rows => rows.map(r => r.dataset.miner)")) == sorted(
        m["id"] for m in latest["miners"])
    assert {sim.nodes[n].node_id for n in ("miner-0", "miner-1")} <= {m["id"] for m in latest["miners"]}
    standings = sim.get(validator.name, "/rewards")["standings"]
    shown = page.eval_on_selector_all("#standings tr[data-miner]", "rows => rows.map(r => r.dataset.miner)")
    assert shown == sorted(standings, key=lambda m: (-standings[m], m))  # best first
    page.screenshot(path=str(tmp_path / "validator.png"), full_page=True)

    mine = {r["round"]: next(m for m in r["miners"] if m["id"] == miner.node_id) for r in reports}
    sim.wait_until(lambda: {h["round"] for h in (sim.get(miner.name, "/status") or {}).get("me") or []} >= set(mine),
                   30, "the miner to learn both rounds' results")  # it ranks a round once it settled
    assert any(m["rank"] is not None and m["reward"] > 0 for m in mine.values()), mine
    phone = browser.new_page(viewport={"width": 390, "height": 1600}, device_scale_factor=2)
    phone.goto(f"http://127.0.0.1:{miner.http_port}/")
    phone.wait_for_selector("body[data-ready='1']", timeout=20_000)
    assert not phone.locator("#me").is_hidden()
    for r, expected in mine.items():
        row = phone.locator(f"#me-table tr.my-round[data-round='{r}']")
        rank = "—" if expected["rank"] is None else str(expected["rank"])
        assert row.locator("td.rank").inner_text() == rank, (r, expected)
        assert float(row.locator("td.reward").inner_text()) == pytest.approx(expected["reward"], abs=1e-3)
    last = mine[reports[-1]["round"]]
    assert phone.locator("#glance-my-reward").inner_text() == f"{last['reward']:.3f}"
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")  # no sideways scroll
    shot = tmp_path / "miner-phone.png"
    phone.screenshot(path=str(shot), full_page=True)
    if NOTES.is_dir():
        shutil.copy(tmp_path / "validator.png", NOTES / "status-page.png")
        shutil.copy(shot, NOTES / "status-page-miner-phone.png")


def test_metrics_of_a_miner_and_a_validator_after_two_rounds(sim: Simulation, completed: list[dict]) -> None:
    validator, miner = sim.nodes["validator-0"], sim.nodes["miner-0"]
    v, m = scrape(validator.http_port), scrape(miner.http_port)

    for samples in (v, m):
        assert 0 < value(samples, "tessera_adopted_loss") < value(samples, "tessera_base_loss") + 1.0
        assert value(samples, "tessera_round") >= ROUNDS - 1
        assert value(samples, "tessera_peers") >= 2
        assert value(samples, "tessera_validator_agreement") == 1.0  # one validator: all of the weight
        assert value(samples, "tessera_phase_duration_seconds_count", phase="train") >= ROUNDS
        assert value(samples, "tessera_phase_overruns_total") >= 0
        assert value(samples, "tessera_round_verdicts", verdict="accept") >= 1
    base_losses = [r["base_loss"] for r in sim.get(validator.name, "/rounds")]
    assert any(value(v, "tessera_base_loss") == pytest.approx(b) for b in base_losses), base_losses

    assert value(v, "tessera_eval_seconds_count") >= ROUNDS  # a submission or more each round
    assert 0 < value(v, "tessera_eval_seconds_sum") < 60 * ROUNDS
    assert value(v, "tessera_scored_total", verdict="accept") >= ROUNDS
    assert value(v, "tessera_blob_fetches_total", result="ok") >= ROUNDS

    mine = [h for h in sim.get(miner.name, "/status")["me"] if h["verdict"] != "missing"][-1]
    assert value(m, "tessera_miner_loss") == pytest.approx(mine["loss"])
    assert value(m, "tessera_miner_rank") == (mine["rank"] or 0)
    assert value(m, "tessera_miner_reward") == pytest.approx(mine["reward"])
    assert value(m, "tessera_train_steps_total") >= ROUNDS
    assert value(m, "tessera_train_tokens_per_second") > 0
    assert value(m, "tessera_bytes_total", channel="blob", direction="out") > 0  # blobs served
    assert value(m, "tessera_blobs_served_total") >= 1  # its submission, fetched by the validator
