"""Validator-side logic on top of `protocol` and `training`: submission checks, Proof-of-Loss,
score combination and aggregation.

Everything here is synchronous and pure over its inputs (bytes, tensors, reports); it does no
networking, no storage and no scheduling. The node package decides when to call it and what to do
with the verdicts.
"""
