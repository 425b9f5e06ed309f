"""The C allocator's policy for a node's process (glibc; no effect elsewhere): freed tensors leave, buffers stay.

A node allocates two kinds of memory over and over. Network buffers of up to 1 MiB (yamux frames, socket
reads of 512 KiB, blob pieces) are allocated and freed thousands of times a blob: mapped and unmapped one by
one, as glibc does above its starting mmap threshold of 128 KiB, their pages were faulted in again frame
after frame (up to 12,000 page faults per 64 MB blob). Expert tensors of 4 to 17 MB (OLMoE-1B-7B's, bf16
and fp32), GBs of them at a time, are held for a phase and freed: served from a heap, as they are once
glibc's adaptive threshold has risen (to each freed mapped block's size, up to 32 MiB), what they held stays
with the heap of the worker thread that freed them, and the next phase often runs in another thread, with
another heap. A real-size validator whose threshold stood at 32 MiB held 3.9 GB free in its heaps after its
merge, 18.2 GB resident; under this policy the same validator was resident at 14.3 GB there.

`set_policy` (first thing in a process: `tessera`'s main, a simulated peer) fixes the mmap threshold at
`MMAP_THRESHOLD`: buffers come from the heaps and keep their pages, tensors are mapped on their own and
unmapped when freed; and the trim threshold at `TRIM_THRESHOLD`, so a heap keeps that much free at its top
for the next buffers. `trim` (after each round phase) hands back the free pages inside every heap, which a
heap's own trimming, from its top only, leaves; `GrowthTrim` does so during a CPU training step, as the step grows
the process (training.trainer).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

MMAP_THRESHOLD = 4 << 20
"""Allocations of this many bytes or more are mapped on their own and unmapped when freed: every expert tensor
of a real-size model; every network buffer is smaller."""
TRIM_THRESHOLD = 64 << 20
"""Free memory a heap keeps at its top before it hands the rest back."""
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def set_policy() -> bool:
    """Fix glibc's mmap and trim thresholds (module docstring); False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def trim() -> bool:
    """Hand the free pages inside every heap back to the system (glibc's malloc_trim); whether any went."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


class GrowthTrim:
    """`trim` whenever the process's resident memory has grown by `TRIM_THRESHOLD` since this last trimmed (or
    was made): called often during work that frees much of what it allocates in the heaps (a training step's
    activations), it hands those pages back as the work grows, and does nothing while the process holds steady."""

    def __init__(self) -> None:
        self._mark = _resident_bytes()

    def __call__(self) -> None:
        if _resident_bytes() - self._mark >= TRIM_THRESHOLD and trim():
            self._mark = _resident_bytes()


def _resident_bytes() -> int:
    """The process's resident memory (Linux's /proc/self/statm); 0 where there is none to read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except OSError:
        return 0
