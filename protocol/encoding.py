"""Canonical encoding: the one way a value becomes bytes before it is hashed or signed.

Canonical JSON is UTF-8, keys sorted, no insignificant whitespace, no NaN or Infinity. Floats are
written by Python's shortest round-trip repr, so the same float always gives the same bytes.
This module knows nothing about messages or specs; it only turns JSON-able data into bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """Encode JSON-able `value` canonically (sorted keys, compact, UTF-8, finite numbers only)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    """Lower-case hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def is_hex_digest(text: str, n_bytes: int = 32) -> bool:
    """True when `text` is exactly `n_bytes` of lower-case hex."""
    if len(text) != 2 * n_bytes:
        return False
    return all(c in "0123456789abcdef" for c in text)
