"""Small helpers over one libp2p stream: exact reads, length-prefixed frames, and a quiet reset.

py-libp2p 0.8.x's `read()` returns b"" or raises at EOF and may return fewer bytes than asked;
these helpers turn that into EOFError and bounded frames. This module knows nothing about what
the bytes mean.
"""

from __future__ import annotations

import logging

from libp2p.abc import INetStream

log = logging.getLogger(__name__)


async def read_exact(stream: INetStream, n: int) -> bytes:
    """Exactly `n` bytes; EOFError when the stream ends first (read() raises at EOF in 0.8.x)."""
    parts, got = [], 0
    while got < n:
        chunk = await stream.read(n - got)
        if not chunk:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


async def write_frame(stream: INetStream, payload: bytes) -> None:
    """A 4-byte big-endian length, then the payload."""
    await stream.write(len(payload).to_bytes(4, "big") + payload)


async def read_frame(stream: INetStream, max_bytes: int) -> bytes:
    """One frame written by `write_frame`; ValueError when it announces more than `max_bytes`."""
    size = int.from_bytes(await read_exact(stream, 4), "big")
    if size > max_bytes:
        raise ValueError(f"frame of {size} bytes exceeds {max_bytes}")
    return await read_exact(stream, size)


async def reset(stream: INetStream) -> None:
    """Abort a stream; a failure to do so is only logged (the connection may already be gone)."""
    try:
        await stream.reset()
    except Exception as exc:
        log.debug("p2p: stream reset failed: %r", exc)
