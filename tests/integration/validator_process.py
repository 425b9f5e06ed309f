"""A real `tessera validator` process on a simulation network, for tests that attack or restart it.

`write_network` makes a network of a tiny model built from its config (no pretraining) whose TRAIN
outlasts a test (so the node's own duties never reach EVALUATE or MERGE and everything it stores
was sent by the test) and the node's config; `start`
runs the node; the rest polls its HTTP API and reads its SQLite file.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from node.sim.layout import sim_identity
from node.sim.twins import until
from protocol.identity import save_identity
from protocol.spec import NetworkSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
V0, V1, NODE = (sim_identity(0, "validator", i) for i in range(3))  # NODE is the validator under test
START_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL = {  # a tiny Qwen3-MoE built from its config and init seed: no pretraining, no download
    "vocab_size": 260, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 64, "tie_word_embeddings": False, "num_experts_per_tok": 2, "num_experts": 4,
    "pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258, "num_hidden_layers": 1,
    "intermediate_size": 64, "moe_intermediate_size": 16, "norm_topk_prob": True,
}


def _arithmetic(count: int, offset: int) -> str:
    return "".join(json.dumps({"text": f"{i % 97} + {i % 89} = {i % 97 + i % 89}."}) + "\n"
                   for i in range(offset, offset + count))


def write_network(tmp: Path) -> tuple[Path, NetworkSpec, int, int]:
    """A network of three validators (the node is the third) and the node's config; spec, ports."""
    from training.data import file_sha256
    from training.model import state_hash
    from training.tiny import build_tiny_model

    net = tmp / "net"
    net.mkdir(parents=True)
    (net / "model.json").write_text(json.dumps(MODEL, sort_keys=True), encoding="utf-8")
    (net / "train.jsonl").write_text(_arithmetic(200, 0), encoding="utf-8")
    (net / "heldout.jsonl").write_text(_arithmetic(40, 100_000), encoding="utf-8")
    save_identity(NODE, net / "node.key")
    genesis = (datetime.now(UTC) - timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    validators = "".join(f'[[validators]]\nkey = "{v.node_id}"\nweight = 1.0\n' for v in (V0, V1, NODE))
    # TRAIN outlasts the test and the skew is wider than the rest of the round, so every message
    # a test sends is on time while the node itself never reaches EVALUATE or MERGE.
    (net / "spec.toml").write_text(f"""name = "node-under-test"
genesis = {genesis}
group = {{ "0" = [1, 2] }}

[timing]
train_s = 300.0
commit_s = 20.0
reveal_s = 20.0
evaluate_s = 20.0
merge_s = 20.0
clock_skew_s = 400.0

[model]
family = "qwen3_moe"
config = "model.json"
init_seed = 0
base_hash = "{state_hash(build_tiny_model("qwen3_moe", dict(MODEL), 0))}"

[data]
train = ["train.jsonl"]
heldout_sha256 = "{file_sha256(net / "heldout.jsonl")}"
tokenizer = "byte"
seq_len = 16
heldout_sequences = 4

{validators}""", encoding="utf-8")
    p2p_port, http_port = free_port(), free_port()
    (tmp / "node.toml").write_text(
        f'[node]\nrole = "validator"\nspec = "net/spec.toml"\nkey = "net/node.key"\n'
        f'[p2p]\nport = {p2p_port}\n[http]\nport = {http_port}\n'
        f'[validator]\nheldout = "net/heldout.jsonl"\n', encoding="utf-8")
    return tmp / "node.toml", load_spec(net / "spec.toml"), p2p_port, http_port


def start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "node.cli", "validator", "--config", str(config)],
                            cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = START_S) -> None:
    """`node.sim.twins.until` at a pace for a process's HTTP API and peers (every 0.2 s)."""
    await until(condition, what, timeout, poll_s=0.2)


def healthy(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def status(http_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
        return json.load(r)


def counts(db: Path) -> dict[str, int]:
    if not db.exists():
        return {}
    conn = sqlite3.connect(db, timeout=5)
    try:
        tables = ("commits", "scores", "score_reports", "global_states", "state_votes")
        return {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables}
    except sqlite3.OperationalError:  # schema not created yet
        return {}
    finally:
        conn.close()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def stored_heartbeats(db: Path) -> dict[tuple[str, int], int]:
    """Accepted heartbeats in the node's message log, counted per (sender, round)."""
    conn = sqlite3.connect(db, timeout=5)
    try:
        rows = conn.execute("SELECT sender, round, COUNT(*) FROM messages WHERE kind = 'heartbeat' "
                            "AND verdict = 'accept' GROUP BY sender, round").fetchall()
    finally:
        conn.close()
    return {(sender, r): n for sender, r, n in rows}
