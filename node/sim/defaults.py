"""A simulation's defaults, in one place: `SimSettings`' fields and `tessera simulate`'s options and help read them.

Plain values and nothing to import, so `tessera --help` stays fast.
"""

from __future__ import annotations

from typing import Literal

VALIDATORS = 2
MINERS = 4
ROUND_SECONDS = 80.0
TRAIN_SHARE = 0.9
INNER_STEPS = 30
SEED = 0
FAMILY = "qwen3_moe"
FORMAT: Literal["experts", "pgrad"] = "experts"
START_DELAY_S, START_DELAY_PER_NODE_S = 10.0, 2.0
"""Genesis by default: this long after the network is written, plus this long per node (bootstrap included)."""
