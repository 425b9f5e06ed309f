"""A pgrad miner's error-feedback buffer (training.pgrad) across rounds and restarts.

The buffer holds what a miner's compressed submissions left unsent, fp32 by expert tensor name. It
is kept as a blob in the miner's blob store whose hash storage records in the same transaction as
the round's submission (`Storage.set_submission`), so a restart resumes with the buffer that
matches the last submission it made, and a round built again after a crash starts from the same
buffer. The buffer lives in pseudo-gradient space, not relative to a state: a round whose base is
not the previous round's head (that state was not adopted, or the miner skipped rounds) simply adds
the residual to its own update. What a round sent that was not merged is lost, not re-sent. A
buffer whose blob is gone or unreadable (a miner away longer than the blob retention), or holds a
NaN or an Inf, starts empty, with a warning; a round whose training diverged submits nothing and
leaves the buffer as it was (miner.submission, where its value type `ErrorFeedback` lives). This
module knows nothing about training, the protocol or scoring.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from miner.submission import ErrorFeedback
from node.runtime.context import NodeContext
from training.pgrad import error_bytes, load_error, pgrad_config

log = logging.getLogger(__name__)


async def load_feedback(ctx: NodeContext, shapes: Mapping[str, tuple[int, ...]]) -> ErrorFeedback | None:
    """The buffer of this miner's last submission (empty before the first); None when the network
    submits full experts."""
    if pgrad_config(ctx.spec) is None:
        return None
    error_hash = await ctx.storage.pgrad_error()
    if error_hash is None:
        return ErrorFeedback()
    data = await asyncio.to_thread(ctx.blobs.read_checked, error_hash)
    try:
        if data is None:
            raise ValueError("its blob is missing or corrupt")
        return ErrorFeedback(await asyncio.to_thread(load_error, data, shapes))
    except ValueError as exc:
        log.warning("error-feedback buffer %s unusable (%s); starting from an empty one", error_hash[:12], exc)
        return ErrorFeedback()


async def keep_feedback(ctx: NodeContext, feedback: ErrorFeedback | None) -> str | None:
    """Store the buffer a round's encoding left as a blob and return its hash (None when there is none),
    for `Storage.set_submission` to record with the submission."""
    if feedback is None or feedback.error is None:
        return None
    return await asyncio.to_thread(ctx.blobs.put_bytes, error_bytes(feedback.error))
