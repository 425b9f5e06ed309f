"""`P2PConfig`: the one settings model of the network layer, the node config's `[p2p]` section.

The node config (node.runtime.config) embeds it as is, so every field can be set in the node TOML
and as `TESSERA_P2P__<FIELD>`; the judge (node.net.judge) reads the budget and penalty numbers,
the libp2p host (node.net.p2p) the rest. It lives outside node.net.p2p so that loading a config
does not import libp2p. This module knows nothing about sockets, messages or the node's roles.
"""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class P2PConfig(BaseModel):
    """Listening, finding peers, pacing gossip, moving blobs, and bounding what a peer may cost us."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="Listen IPv4 address; 0.0.0.0 accepts peers from other hosts.")
    port: int = Field(default=4001, ge=0, le=65535, description="Listen TCP port; 0 picks a free one.")
    announce: tuple[str, ...] = Field(
        default=(), description="Addresses peers are told to dial, /ip4/A/tcp/P or /dns4/NAME/tcp/P, for a host behind "
        "NAT or a port forward (its public address and forwarded port); empty: the listen address."
    )
    bootstrap: tuple[str, ...] = Field(
        default=(), description="Bootstrap multiaddrs ending in /p2p/<peer id> (give several); redialled forever."
    )
    max_peers: int = Field(default=32, ge=1, le=1024, description=(
        "Stop dialling discovered peers at this many; the gossip mesh is pruned only past this many links "
        "(12 at least)."))
    publish_interval_s: float = Field(
        default=0.005, ge=0, description="Gap between two of our publishes; bursts queue instead of being dropped."
    )
    supervise_interval_s: float = Field(
        default=1.0, gt=0, description="How often lost peers are redialled and the peer list refreshed."
    )
    exchange_interval_s: float = Field(default=10.0, gt=0, description="How often each peer is asked for its peers.")
    dial_timeout_s: float = Field(default=5.0, gt=0, description="Give up one dial after this long.")
    blob_idle_timeout_s: float = Field(default=30.0, gt=0, description="Abort a blob transfer idle this long.")
    # 64 KiB/s is about a 20th of a 10 Mbit/s home uplink: a provider serving a dozen fetchers at once
    # still gives each half again as much, and the idle timeout on top covers small blobs and slow starts;
    # a peer that drips bytes to hold a transfer open has to send at least this much to do so.
    blob_min_rate_bytes_s: float = Field(
        default=64 * 1024,
        gt=0,
        description="Abort a blob transfer (either side) not done in blob_idle_timeout_s + size / this rate.",
    )
    blob_chunk_bytes: int = Field(
        default=1 << 20, ge=1, description="Bytes per write when serving a blob and per disk write when fetching."
    )
    max_serves_per_peer: int = Field(
        default=2, ge=1, description="Blob streams served to one peer at once; more are answered busy."
    )
    serve_rate_bytes_s: float = Field(
        default=0.0, ge=0, description="Upload cap per blob stream in bytes/s; 0 serves as fast as the link allows."
    )
    sender_budget: int = Field(
        default=32, ge=8, description="Signed messages judged per sender per round; later ones are IGNOREd unread."
    )
    penalty_threshold: int = Field(
        default=20, ge=1, description="REJECTs a peer may send in one round; past it, it is disconnected and barred."
    )
    penalty_backoff_s: float = Field(
        default=300.0, gt=0, description="How long a penalised peer stays disconnected and is not redialled."
    )

    @model_validator(mode="after")
    def _serve_rate_above_min_rate(self) -> P2PConfig:
        if 0 < self.serve_rate_bytes_s < self.blob_min_rate_bytes_s:
            raise ValueError(
                f"serve_rate_bytes_s ({self.serve_rate_bytes_s:g}) is below blob_min_rate_bytes_s "
                f"({self.blob_min_rate_bytes_s:g}): fetchers abort transfers that slow; raise it, or set 0 for no cap"
            )
        return self

    @field_validator("host")
    @classmethod
    def _ipv4(cls, value: str) -> str:
        try:
            ipaddress.IPv4Address(value)  # the host listens on /ip4/<host>/tcp/<port>
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv4 address like 127.0.0.1 or 0.0.0.0") from None
        return value

    @field_validator("announce")
    @classmethod
    def _dialable(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for addr in value:
            if not _dialable(addr):
                raise ValueError(f"{addr!r} is not an address peers can dial, like /ip4/203.0.113.7/tcp/4001 or "
                                 "/dns4/node.example.org/tcp/4001 (the node adds /p2p/<its peer id>)")
        return value

    @field_validator("bootstrap")
    @classmethod
    def _multiaddrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for addr in value:
            if not addr.startswith("/") or "/p2p/" not in addr:
                raise ValueError(f"{addr!r} is not a multiaddr like /ip4/1.2.3.4/tcp/4001/p2p/<peer id>")
        return value


def _dialable(addr: str) -> bool:
    """Whether `addr` is /ip4/A/tcp/P (A an address other hosts can dial, not 0.0.0.0) or /dns4/NAME/tcp/P."""
    match = re.fullmatch(r"/(ip4|dns4)/([^/]+)/tcp/(\d{1,5})", addr)
    if match is None or not 1 <= int(match[3]) <= 65535:
        return False
    if match[1] == "dns4":
        return re.fullmatch(r"(?=.*[A-Za-z])[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", match[2]) is not None
    try:
        return not ipaddress.IPv4Address(match[2]).is_unspecified
    except ValueError:
        return False
