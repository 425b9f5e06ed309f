"""A `tessera` node whose every held-out loss is off by up to a part in a million, standing for a validator on
other hardware: another GPU's kernels, another summation order. Each sequence's summed loss
(`training.evaluate.row_loss_sums`, from which every score, base loss and gate loss is built) is multiplied by
1 + u, u drawn uniformly from ±JITTER by a generator of the process's own, so no two measurements of the same
state agree in their last digits. Run as a `SimNode.program` (tests/integration/test_unlike_validators.py);
nothing in the product imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

JITTER = 1e-6


def main(argv: Sequence[str]) -> int:
    import training.evaluate as evaluate
    from node.cli.main import main as tessera

    measured = evaluate.row_loss_sums
    generator = torch.Generator().manual_seed(20261207)

    def jittered(model: torch.nn.Module, ids_BL: torch.Tensor, pad_id: int) -> torch.Tensor:
        sums_B = measured(model, ids_BL, pad_id)
        u_B = (torch.rand(sums_B.shape, generator=generator, dtype=torch.float64) * 2 - 1) * JITTER
        return (sums_B.double() * (1 + u_B)).to(sums_B.dtype)

    evaluate.row_loss_sums = jittered  # this process only: it is the node under test
    return tessera(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
