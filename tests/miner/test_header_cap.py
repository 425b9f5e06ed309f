"""A miner whose blob's header would be over the spec's `limits.max_header_bytes` (a large group in the
pgrad format, whose header names three tensors per expert tensor) says so before committing, instead
of committing a blob every validator refuses; a pgrad miner's error-feedback buffer is left as it was."""

from __future__ import annotations

import pytest
import torch

from miner.submission import ErrorFeedback, encode_submission
from protocol.spec import parse_spec
from tests.conftest import make_spec_dict

SHAPES = {f"layers.0.experts.1.p{i:02d}": (4, 4) for i in range(40)}


@pytest.mark.parametrize("format", ["experts", "pgrad"])
def test_a_blob_over_the_header_cap_is_refused_before_it_is_committed(format: str) -> None:
    spec_dict = {**make_spec_dict(), "limits": {"max_header_bytes": 1024}}
    if format == "pgrad":
        spec_dict["submission"] = {"format": "pgrad"}
    spec = parse_spec(spec_dict)
    base = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    trained = {name: torch.full(shape, 0.5) for name, shape in SHAPES.items()}
    before = {name: torch.full(shape, 0.25) for name, shape in SHAPES.items()}
    feedback = ErrorFeedback({name: t.clone() for name, t in before.items()})
    with pytest.raises(ValueError, match=r"header is \d+ bytes, over the spec's limits.max_header_bytes \(1024\)"):
        encode_submission(spec, 1, "ab" * 32, "cd" * 32, trained, base, feedback)
    assert feedback.error is not None and all(torch.equal(feedback.error[n], before[n]) for n in SHAPES)
    roomy = parse_spec({**spec_dict, "limits": {"max_header_bytes": 1 << 20}})
    assert len(encode_submission(roomy, 1, "ab" * 32, "cd" * 32, trained, base, feedback)) > 0
