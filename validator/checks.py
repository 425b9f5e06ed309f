"""Submission checks: does a revealed blob match what its miner committed to for this round?

`check_submission` runs DESIGN §5's checks in order over the blob's bytes and stops at the first
failure with a short, distinct reason a validator logs and reports. A network whose spec asks for
compressed pseudo-gradients (`[submission] format = "pgrad"`) gets the same checks over that
format's tensors (training.pgrad: names, dtypes and shapes follow from the expert shapes), then
`check_compressed` on their values instead of the finiteness check. `submission_cap` is the size cap
of the network's own format, the most a validator fetches for one blob. It is pure: no I/O, no clock,
and it never unpickles; any bytes a peer sends give a verdict, never an exception. It does not
know where the blob came from or how its loss will be measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from protocol.spec import NetworkSpec
from training.blob import (
    BLOB_FORMAT,
    PGRAD_FORMAT,
    BlobError,
    BlobMeta,
    Header,
    blob_dtype,
    blob_hash,
    decode_header,
    max_blob_bytes,
    read_tensor,
)
from training.pgrad import (
    PgradConfig,
    check_compressed,
    chunk_draw,
    compressed_bytes,
    compressed_shapes,
    pgrad_config,
)


@dataclass(frozen=True)
class Expectation:
    """What a valid submission for one miner in one round must be."""

    network: str
    round: int
    miner: str
    base: str
    group: Mapping[int, list[int]]
    shapes: Mapping[str, tuple[int, ...]]
    dtype: str
    commitment: str
    max_header_bytes: int
    pgrad: PgradConfig | None = None
    """The compressed format's parameters when the network submits pseudo-gradients; None: full experts."""
    predecessor: str | None = None
    """Network id of the spec the one in force succeeds (None: a genesis spec), whose submissions are refused as
    the old expert group's."""
    since_round: int = 0
    """The first round of the spec in force."""

    @property
    def draw(self) -> int:
        """The draw that picks the chunks this miner's pgrad blob carries this round."""
        return chunk_draw(self.network, self.round, self.miner)

    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Blob tensor name -> (dtype code, shape) a valid submission holds."""
        if self.pgrad is not None:
            return compressed_shapes(self.shapes, self.pgrad, self.draw)
        code = blob_dtype(self.dtype)
        return {name: (code, tuple(shape)) for name, shape in self.shapes.items()}

    def max_bytes(self) -> int:
        """The size cap: length prefix, header cap and the format's tensor data."""
        return _max_bytes(self.shapes, self.dtype, self.max_header_bytes, self.pgrad)


@dataclass(frozen=True)
class SubmissionVerdict:
    """ACCEPT (`ok`) with the decoded blob and its validated header, or REJECT with the first failed check's reason."""

    ok: bool
    reason: str
    meta: BlobMeta | None = None
    tensors: Mapping[str, torch.Tensor] | None = None
    header: Header | None = None


def check_submission(data: bytes, expect: Expectation) -> SubmissionVerdict:
    """Check `data` against `expect` in protocol order; the verdict names the first failure."""
    if blob_hash(data) != expect.commitment:
        return _reject("hash mismatch")
    if len(data) > expect.max_bytes():
        return _reject("blob too large")
    try:
        header = decode_header(data, expect.max_header_bytes)
    except BlobError as exc:
        return _reject(exc.reason)
    reason = _meta_mismatch(header.meta, expect) or _tensor_mismatch(header, expect)
    if reason:
        return _reject(reason, header.meta)
    tensors = {name: read_tensor(data, header, name) for name in header.tensors}
    if expect.pgrad is not None:
        reason = check_compressed(tensors, expect.shapes, expect.pgrad, expect.draw)
        if reason:
            return _reject(reason, header.meta)
        return SubmissionVerdict(ok=True, reason="", meta=header.meta, tensors=tensors, header=header)
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
            return _reject(f"non-finite values in {name}: {nan} NaN, {inf} Inf", header.meta)
    return SubmissionVerdict(ok=True, reason="", meta=header.meta, tensors=tensors, header=header)


def submission_cap(spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The largest a valid submission of `spec`'s network can be, in its own format: the fetch limit."""
    return _max_bytes(shapes, spec.model.dtype, spec.limits.max_header_bytes, pgrad_config(spec))


def _max_bytes(shapes: Mapping[str, tuple[int, ...]], dtype: str, max_header_bytes: int,
               pgrad: PgradConfig | None) -> int:
    if pgrad is not None:
        return 8 + max_header_bytes + compressed_bytes(shapes, pgrad)
    return max_blob_bytes(shapes, dtype, max_header_bytes)


def _reject(reason: str, meta: BlobMeta | None = None) -> SubmissionVerdict:
    return SubmissionVerdict(ok=False, reason=reason, meta=meta)


def _meta_mismatch(meta: BlobMeta, expect: Expectation) -> str:
    if meta.format != (BLOB_FORMAT if expect.pgrad is None else PGRAD_FORMAT):
        return "wrong format"
    if meta.network != expect.network and meta.network == expect.predecessor:
        return (f"old expert group: a submission for the spec that ended at round {expect.since_round - 1}; "
                f"from round {expect.since_round} its successor trains another group")
    if meta.network != expect.network:
        return "wrong network"
    if meta.round != expect.round:
        return "wrong round"
    if meta.miner != expect.miner:
        return "wrong miner"
    if meta.base != expect.base:
        return "stale base"
    if meta.group != _normalized(expect.group):
        return "wrong group"
    return ""


def _tensor_mismatch(header: Header, expect: Expectation) -> str:
    specs = expect.tensor_specs()
    missing = sorted(set(specs) - set(header.tensors))
    if missing:
        return f"missing tensor {missing[0]}"
    unexpected = sorted(set(header.tensors) - set(specs))
    if unexpected:
        return f"unexpected tensor {unexpected[0][:80]}"
    for name, info in header.tensors.items():
        dtype, shape = specs[name]
        if info.dtype != dtype:
            return f"wrong dtype for {name}: {info.dtype}, expected {dtype}"
        if info.shape != shape:
            return f"wrong shape for {name}: {list(info.shape)}, expected {list(shape)}"
    return ""


def _normalized(group: Mapping[int, list[int]]) -> dict[int, list[int]]:
    return {layer: sorted(ids) for layer, ids in group.items()}
